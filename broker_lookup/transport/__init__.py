"""Talking to Redis: clients made from a config, cluster routing, pipelined batches."""
