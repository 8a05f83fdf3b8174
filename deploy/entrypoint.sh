#!/bin/sh
# Container entrypoint: the first argument picks the service, the rest are its flags.
#   gateway | verifier | draft       run that service (python -m gateway|verifier_service|draft_service)
#   healthcheck ADDR                 grpc.health.v1 probe (python -m specmesh.healthcheck)
#   specmesh ARGS                    the CLI (e.g. `specmesh models list`)
#   anything else                    run as a command
set -e
service="${1:-gateway}"
[ "$#" -gt 0 ] && shift
case "$service" in
  gateway) exec python -m gateway "$@" ;;
  verifier|verifier_service) exec python -m verifier_service "$@" ;;
  draft|draft_service) exec python -m draft_service "$@" ;;
  healthcheck) exec python -m specmesh.healthcheck "$@" ;;
  specmesh) exec specmesh "$@" ;;
  *) exec "$service" "$@" ;;
esac
