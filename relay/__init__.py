"""The outbox relay: claims committed outbox rows and delivers them to Kafka or webhooks."""
