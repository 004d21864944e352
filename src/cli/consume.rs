//! `almanac consume --sink kafka|rabbitmq --destination NAME --handler KIND='COMMAND'`

use anyhow::bail;

use super::sinks::SinkFlags;
use super::work::WorkerFlags;
use super::Ctx;
use crate::consumer::{Consumer, ConsumerConfig};
use crate::http::HttpAddr;
use crate::metrics::Metrics;
use crate::relay::SinkKind;
use crate::worker::exec::parse_handler_spec;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long, env = "ALMANAC_SINK", value_enum)]
    sink: SinkKind,
    /// Kafka topic, or RabbitMQ queue.
    #[arg(long, env = "ALMANAC_DESTINATION")]
    destination: String,
    /// Kafka consumer group [default: almanac-DESTINATION].
    #[arg(long, env = "ALMANAC_GROUP")]
    group: Option<String>,
    /// KIND=COMMAND, as for `almanac work`.
    #[arg(long = "handler", env = "ALMANAC_HANDLERS", value_delimiter = '\n', required = true, value_parser = parse_handler_spec)]
    handlers: Vec<(String, String)>,
    #[command(flatten)]
    worker: WorkerFlags,
    #[command(flatten)]
    http: super::ops::HttpFlags,
    #[command(flatten)]
    tracing: super::tracing_flags::TracingFlags,
    #[command(flatten)]
    sinks: SinkFlags,
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<()> {
    let worker = args.worker.resolve(ctx)?;
    // Handlers get the shutdown deadline; the rest gets 15 s more.
    let grace = worker.shutdown_deadline + std::time::Duration::from_secs(15);
    args.worker.warn_unset_pass_env();
    let sinks = args.sinks.resolve(ctx)?;
    if !sinks.configured().contains(&args.sink) {
        bail!(
            "--sink {} needs {}",
            args.sink,
            match args.sink {
                SinkKind::Kafka => "--kafka-brokers (or ALMANAC_KAFKA_BROKERS)",
                SinkKind::Rabbitmq => "--amqp-url (or ALMANAC_AMQP_URL)",
            }
        );
    }
    // Off unless set, so several workers can share a host.
    let http = args.http.bind(ctx, HttpAddr::OFF).await?;
    // Before the database too: a bad endpoint or ratio fails the start.
    let tracer = args.tracing.tracer(ctx)?;
    let pool = ctx.migrated_pool(4).await?;
    let config = ConsumerConfig {
        sink: args.sink,
        destination: args.destination,
        group: args.group,
        worker,
    };
    let metrics = Metrics::new();
    let mut consumer = Consumer::new(pool, sinks, config)
        .with_metrics(metrics.clone())
        .with_tracer(tracer.clone());
    for (kind, command) in args.handlers {
        consumer = consumer.register(kind, args.worker.exec_handler(ctx, command));
    }
    super::work::run_with_http(consumer, http, metrics, tracer, grace).await
}
