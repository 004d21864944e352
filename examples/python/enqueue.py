"""Enqueue an almanac job from Python in the same transaction as a business row.

    pip install -r requirements.txt     # psycopg 3
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/almanac \\
        python enqueue.py commit|rollback [ORDER_ID] [PAYLOAD]

Inserts order ORDER_ID (default 1) into `orders` (created if missing) and
enqueues a `send_order_confirmation` job for it with almanac.enqueue(...),
keyed by the order, then commits or rolls back both. PAYLOAD, when given, is
sent as text in place of the default payload: the server parses it as jsonb,
so text that is not JSON fails the call (SQLSTATE 22P02) and nothing is
written. Prints `order N: job ID (new|existing), committed` or `..., rolled
back`; an error prints its SQLSTATE and message and exits 1. The database
needs almanac's migrations (`almanac migrate`).
"""

import os
import sys

import psycopg
from psycopg.types.json import Jsonb


def main() -> int:
    args = sys.argv[1:]
    if not args or args[0] not in ("commit", "rollback"):
        print("usage: python enqueue.py commit|rollback [ORDER_ID] [PAYLOAD]", file=sys.stderr)
        return 2
    outcome = args[0]
    order_id = int(args[1]) if len(args) > 1 else 1
    # A dict goes as jsonb (Jsonb); a str goes as text, which the server
    # casts (`::jsonb`), so text that is not JSON fails there.
    payload = args[2] if len(args) > 2 else Jsonb({"order_id": order_id})

    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS orders"
            " (id bigint PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now())"
        )
    # psycopg opens a transaction with the first statement; commit() or
    # rollback() ends it, and leaving the block on an error rolls it back.
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        try:
            conn.execute("INSERT INTO orders (id) VALUES (%s)", (order_id,))
            job_id, created = conn.execute(
                """
                SELECT id, created FROM almanac.enqueue(
                    kind => 'send_order_confirmation',
                    payload => %s::jsonb,
                    idempotency_key => %s,
                    priority => %s)
                """,
                (payload, f"order:{order_id}:confirmation", 5),
            ).fetchone()
        except psycopg.Error as err:
            conn.rollback()
            print(f"error {err.sqlstate}: {err.diag.message_primary}", file=sys.stderr)
            return 1
        if outcome == "commit":
            conn.commit()
            done = "committed"
        else:
            conn.rollback()
            done = "rolled back"
    print(f"order {order_id}: job {job_id} ({'new' if created else 'existing'}), {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
