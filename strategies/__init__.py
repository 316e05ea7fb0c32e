"""Server side: the ServerApp, the block-coordinate coordinator, aggregation, scheduling, checkpoints."""
