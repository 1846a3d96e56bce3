"""Transport: the ZeroMQ wire (msgspec codec, framed tensors) and weight shipping (shards, broadcast)."""
