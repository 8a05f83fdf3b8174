#!/bin/sh
# Container entrypoint: the first argument picks the service, the rest are its flags.
#   gateway | verifier | draft       run that service (python -m gateway|verifier_service|draft_service)
#   healthcheck ADDR                 grpc.health.v1 probe (python -m specmesh.ops.healthcheck)
#   specmesh ARGS                    the CLI (e.g. `specmesh models list`)
#   anything else                    run as a command
set -e
# A model service refuses to start on a model reference it cannot load, with one clear line (e.g. "model preset
# 'qwen2.5-coder-1.5b' is not fetched into /models/models: run `specmesh models fetch` first ...").
check_model() {
  case " $* " in *" --model"*) return 0 ;; esac   # a --model flag: the service itself reports a bad one
  python -m specmesh.models.catalog "$model" || exit 1
}
service="${1:-gateway}"
[ "$#" -gt 0 ] && shift
case "$service" in
  gateway) exec python -m gateway "$@" ;;
  verifier|verifier_service) model="${SPECMESH_VERIFIER_MODEL:-tiny-target}"; check_model "$@"
    exec python -m verifier_service "$@" ;;
  draft|draft_service) model="${SPECMESH_DRAFT_MODEL:-tiny-draft}"; check_model "$@"
    exec python -m draft_service "$@" ;;
  healthcheck) exec python -m specmesh.ops.healthcheck "$@" ;;
  specmesh) exec specmesh "$@" ;;
  *) exec "$service" "$@" ;;
esac
