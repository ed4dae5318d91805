"""The vLLM KV connector (filled in by the connector work)."""
