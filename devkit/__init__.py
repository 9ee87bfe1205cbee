"""Development helpers shared by the tests, bench/ and scripts/: never installed, never in
a service image (the runtime packages under common/ and services/ must not import them).

- `stack`: the one launcher of the whole pipeline as processes (the tests' session stack,
  bench/ and `make run`).
- `service_process`: one Conveyor service as a real process, its settings as environment,
  and the environment that runs one without torch as its container does.
- `local_redis`: the Redis of tests, bench and `make run`: its URL, starting one (never for
  the tests), deleting a run's keys.
- `replica_processes`: registered replicas as processes (the failover and cross-host tests).
- `random_step`: random paged-attention steps, one attention backend against another.
- `random_model`: Llama models of named shapes with random weights.
- `deploy_manifests`: the compose files and Kustomize overlays read as their tools read them
  (the deployment tests).

Importable from the repository root (pytest puts it on sys.path; bench/ and scripts/ add it).
"""
