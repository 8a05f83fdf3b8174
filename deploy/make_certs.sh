#!/usr/bin/env bash
# Makes a local certificate authority and certificates for the specmesh services (TLS / mutual TLS).
#   deploy/make_certs.sh [--out DIR] [--readable]        (default DIR: deploy/certs, git-ignored)
# Writes DIR/ca.pem + ca.key (reused when present) and, for each of verifier, draft, gateway and client,
# DIR/<name>.pem + <name>.key: EC P-256, valid for both server and client authentication, with the SANs
# <name>, specmesh-<name>, localhost, 127.0.0.1 and $EXTRA_SANS (e.g. EXTRA_SANS="DNS:api.example.com").
# --readable makes the keys readable by all (needed when mounting them into containers that run as uid 10001).
# Configure a service with SPECMESH_<SERVICE>_TLS_CERT / _TLS_KEY (its port), _TLS_CLIENT_CA (require client
# certificates), _TLS_CA / _TLS_CLIENT_CERT / _TLS_CLIENT_KEY (the services it calls).
set -euo pipefail
OUT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/certs"
KEY_MODE=600
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --readable) KEY_MODE=644; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
DAYS="${DAYS:-825}"
mkdir -p "$OUT"
umask 077

if [ ! -f "$OUT/ca.pem" ] || [ ! -f "$OUT/ca.key" ]; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$OUT/ca.key"
  openssl req -x509 -new -key "$OUT/ca.key" -sha256 -days 3650 -subj "/O=specmesh/CN=specmesh local CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$OUT/ca.pem" 2>/dev/null
  echo "made CA $OUT/ca.pem"
fi

for name in verifier draft gateway client; do
  ext="$(mktemp)"
  sans="DNS:$name,DNS:specmesh-$name,DNS:localhost,IP:127.0.0.1${EXTRA_SANS:+,$EXTRA_SANS}"
  printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" "subjectAltName=$sans" > "$ext"
  openssl ecparam -name prime256v1 -genkey -noout -out "$OUT/$name.key"
  openssl req -new -key "$OUT/$name.key" -subj "/O=specmesh/CN=$name" -out "$OUT/$name.csr" 2>/dev/null
  openssl x509 -req -in "$OUT/$name.csr" -CA "$OUT/ca.pem" -CAkey "$OUT/ca.key" -CAcreateserial -sha256 \
    -days "$DAYS" -extfile "$ext" -out "$OUT/$name.pem" 2>/dev/null
  rm -f "$OUT/$name.csr" "$ext"
  chmod "$KEY_MODE" "$OUT/$name.key"
  chmod 644 "$OUT/$name.pem"
  echo "made $OUT/$name.pem ($sans)"
done
chmod 644 "$OUT/ca.pem"
