"""Development helpers shared by the tests, bench/ and scripts/: never installed, never in
a service image (the runtime packages under common/ and services/ must not import them).

- `service_process`: a Conveyor service as a real process (tests, bench, `make run`), and
  the environment that runs one without torch as its container does.
- `replica_processes`: registered replicas as processes (the failover and cross-host tests).
- `random_step`: random paged-attention steps, one attention backend against another.
- `random_model`: Llama models of named shapes with random weights.

Importable from the repository root (pytest puts it on sys.path; bench/ and scripts/ add it).
"""
