"""What a rank does with each request: read, decide, run the engine, report, ack."""
