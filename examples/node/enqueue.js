// Enqueue an almanac job from Node in the same transaction as a business row.
//
//   npm ci
//   DATABASE_URL=postgres://postgres@127.0.0.1:5432/almanac node enqueue.js commit|rollback [ORDER_ID] [PAYLOAD]
//
// Inserts order ORDER_ID (default 1) into `orders` (created if missing) and
// enqueues a `send_order_confirmation` job for it with almanac.enqueue(...),
// keyed by the order, then commits or rolls back both. PAYLOAD, when given,
// is sent as text in place of the default payload: the server parses it
// as jsonb, so text that is not JSON fails the call (SQLSTATE 22P02) and
// nothing is written. Prints `order N: job ID (new|existing), committed` or
// `..., rolled back`; an error prints its SQLSTATE and message and exits 1.
// The database needs almanac's migrations (`almanac migrate`).
'use strict';

const { Client } = require('pg');

async function main() {
  const [outcome, orderArg = '1', payloadArg] = process.argv.slice(2);
  if (outcome !== 'commit' && outcome !== 'rollback') {
    throw new Error('usage: node enqueue.js commit|rollback [ORDER_ID] [PAYLOAD]');
  }
  const orderId = Number.parseInt(orderArg, 10);
  const client = new Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  try {
    await client.query(
      'CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now())'
    );
    await client.query('BEGIN');
    await client.query('INSERT INTO orders (id) VALUES ($1)', [orderId]);
    // node-postgres sends parameters untyped: the server takes each as the
    // named parameter's type (an object is sent as its JSON text).
    const payload = payloadArg ?? { order_id: orderId };
    const { rows } = await client.query(
      `SELECT id, created FROM almanac.enqueue(
           kind => 'send_order_confirmation',
           payload => $1,
           idempotency_key => $2,
           priority => $3)`,
      [payload, `order:${orderId}:confirmation`, 5]
    );
    const [{ id, created }] = rows;
    if (outcome === 'commit') {
      await client.query('COMMIT');
    } else {
      await client.query('ROLLBACK');
    }
    const done = outcome === 'commit' ? 'committed' : 'rolled back';
    console.log(`order ${orderId}: job ${id} (${created ? 'new' : 'existing'}), ${done}`);
  } catch (err) {
    // Any error aborts the transaction: neither the order nor the job exists.
    await client.query('ROLLBACK').catch(() => {});
    throw err;
  } finally {
    await client.end();
  }
}

main().catch((err) => {
  console.error(err.code ? `error ${err.code}: ${err.message}` : String(err.message || err));
  process.exit(1);
});
