"""DDMA: direct trainer-shard -> generator-shard weight sync (plan, wire format, engine)."""
