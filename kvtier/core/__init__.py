"""The core: block keys, plan ops, leases, the controller, config, the builder, the executor."""
