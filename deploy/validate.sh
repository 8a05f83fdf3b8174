#!/usr/bin/env bash
# Validates what CI cannot run: the docker-compose file (Debian's docker-compose 1.29, no engine needed) and the
# Kubernetes manifests (kubernetes-validate --strict, offline schemas), plus the Grafana/Prometheus files parse.
# Installs docker-compose (apt-get) and kubernetes-validate (pip, into the venv) when missing.
# Usage: deploy/validate.sh        (env: VENV=path/to/venv, default .venv at the repository root)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
failures=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

ensure_docker_compose() {
  command -v docker-compose >/dev/null 2>&1 && return 0
  echo "installing docker-compose (apt-get)..."
  local sudo=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
  { $sudo apt-get install -y docker-compose || { $sudo apt-get update && $sudo apt-get install -y docker-compose; }; } \
    >/tmp/specmesh-apt-docker-compose.log 2>&1
  command -v docker-compose >/dev/null 2>&1
}

ensure_kubernetes_validate() {
  "$PY" -c "import kubernetes_validate" 2>/dev/null && return 0
  echo "installing kubernetes-validate (pip)..."
  "$PY" -m pip install --quiet "kubernetes-validate>=1.37" >/tmp/specmesh-pip-kubernetes-validate.log 2>&1
}

# 1. docker-compose file
if ensure_docker_compose; then
  if out="$(docker-compose -f "$ROOT/deploy/docker-compose.yml" config -q 2>&1)"; then
    pass "docker-compose config -q deploy/docker-compose.yml ($(docker-compose version --short 2>/dev/null))"
  else
    fail "docker-compose config deploy/docker-compose.yml: $out"
  fi
else
  fail "docker-compose is not installed and could not be installed (see /tmp/specmesh-apt-docker-compose.log)"
fi

# 1b. the TLS / API-key overlay on top of it
if command -v docker-compose >/dev/null 2>&1; then
  if out="$(SPECMESH_API_KEYS=validate docker-compose -f "$ROOT/deploy/docker-compose.yml" \
      -f "$ROOT/deploy/docker-compose.tls.yml" config -q 2>&1)"; then
    pass "docker-compose config -q deploy/docker-compose.yml + deploy/docker-compose.tls.yml"
  else
    fail "docker-compose config with deploy/docker-compose.tls.yml: $out"
  fi
fi

# 2. Kubernetes manifests (every YAML under deploy/k8s except the kustomization)
if ensure_kubernetes_validate; then
  mapfile -t manifests < <(find "$ROOT/deploy/k8s" -name '*.yaml' ! -name 'kustomization.yaml' | sort)
  if out="$("$PY" -m kubernetes_validate --strict "${manifests[@]}" 2>&1)"; then
    pass "kubernetes-validate --strict: $(grep -c ' passed ' <<<"$out") resources in ${#manifests[@]} files"
  else
    fail "kubernetes-validate --strict:"$'\n'"$(grep -v ' passed ' <<<"$out")"
  fi
else
  fail "kubernetes-validate is not installed and could not be installed (see /tmp/specmesh-pip-kubernetes-validate.log)"
fi

# 3. Grafana dashboard / provisioning and Prometheus config parse
if out="$("$PY" - "$ROOT/deploy" 2>&1 <<'PYEOF'
import json, sys, pathlib, yaml
deploy = pathlib.Path(sys.argv[1])
for path in sorted((deploy / "grafana" / "dashboards").glob("*.json")):
    dash = json.loads(path.read_text())
    assert dash["panels"] and all(p["targets"] for p in dash["panels"]), f"{path}: panel without a query"
for path in [deploy / "prometheus.yml", *sorted((deploy / "grafana" / "provisioning").rglob("*.yml"))]:
    assert yaml.safe_load(path.read_text()), f"{path} is empty"
PYEOF
)"; then
  pass "grafana dashboards, provisioning and prometheus.yml parse"
else
  fail "grafana/prometheus files: $out"
fi

if [ "$failures" -ne 0 ]; then
  echo "deploy/validate.sh: $failures check(s) failed"
  exit 1
fi
echo "deploy/validate.sh: all checks passed"
