"""YAML tier stacks shipped with kvtier."""
