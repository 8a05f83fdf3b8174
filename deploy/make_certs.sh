#!/usr/bin/env bash
# Makes two local certificate authorities and certificates for specmesh (TLS / mutual TLS).
#   deploy/make_certs.sh [--out DIR] [--readable]        (default DIR: deploy/certs, git-ignored)
# Internal CA, DIR/ca.pem + ca.key: signs verifier, draft and gateway (DIR/<name>.pem + <name>.key; serverAuth and
#   clientAuth; SANs <name>, specmesh-<name>, localhost, 127.0.0.1 and $EXTRA_SANS, e.g. "DNS:api.example.com").
#   Internal services trust only this CA for client certificates (SPECMESH_<S>_TLS_CLIENT_CA=ca.pem) and let only
#   the gateway call them (SPECMESH_<S>_TLS_ALLOWED_PEERS=gateway).
# Client CA, DIR/client-ca.pem + client-ca.key: signs end-user certificates, here DIR/client.pem + client.key
#   (clientAuth only, CN and SAN "client"). Internal services refuse them; a gateway may require them on its public
#   port with SPECMESH_GATEWAY_TLS_CLIENT_CA=client-ca.pem. Clients verify the gateway with ca.pem.
# Both CAs are reused when present; leaf certificates are made anew on every run.
# --readable makes the keys readable by all (needed when mounting them into containers that run as uid 10001).
set -euo pipefail
OUT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/certs"
KEY_MODE=600
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --readable) KEY_MODE=644; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
DAYS="${DAYS:-825}"
mkdir -p "$OUT"
umask 077

make_ca() {  # make_ca FILE_STEM SUBJECT
  if [ ! -f "$OUT/$1.pem" ] || [ ! -f "$OUT/$1.key" ]; then
    openssl ecparam -name prime256v1 -genkey -noout -out "$OUT/$1.key"
    openssl req -x509 -new -key "$OUT/$1.key" -sha256 -days 3650 -subj "$2" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out "$OUT/$1.pem" 2>/dev/null
    echo "made CA $OUT/$1.pem"
  fi
  chmod 644 "$OUT/$1.pem"
}

make_leaf() {  # make_leaf NAME CA_STEM EXTENDED_KEY_USAGE SANS
  local ext
  ext="$(mktemp)"
  printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=$3" "subjectAltName=$4" > "$ext"
  openssl ecparam -name prime256v1 -genkey -noout -out "$OUT/$1.key"
  openssl req -new -key "$OUT/$1.key" -subj "/O=specmesh/CN=$1" -out "$OUT/$1.csr" 2>/dev/null
  openssl x509 -req -in "$OUT/$1.csr" -CA "$OUT/$2.pem" -CAkey "$OUT/$2.key" -CAcreateserial -sha256 \
    -days "$DAYS" -extfile "$ext" -out "$OUT/$1.pem" 2>/dev/null
  rm -f "$OUT/$1.csr" "$ext"
  chmod "$KEY_MODE" "$OUT/$1.key"
  chmod 644 "$OUT/$1.pem"
  echo "made $OUT/$1.pem (signed by $2.pem; $4)"
}

make_ca ca "/O=specmesh/OU=internal/CN=specmesh internal CA"
make_ca client-ca "/O=specmesh/OU=clients/CN=specmesh client CA"
for name in verifier draft gateway; do
  make_leaf "$name" ca "serverAuth,clientAuth" \
    "DNS:$name,DNS:specmesh-$name,DNS:localhost,IP:127.0.0.1${EXTRA_SANS:+,$EXTRA_SANS}"
done
make_leaf client client-ca "clientAuth" "DNS:client"
