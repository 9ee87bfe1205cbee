"""The model runner: a SchedulerOutput in, sampled tokens out; owns the KV pool."""
