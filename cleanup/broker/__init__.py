"""The broker, read: queue depth, age and unacked count, and the bounds every broker entry
must meet before anything trusts it. Below the release core, which reads the depth for
backpressure."""
