#!/usr/bin/env bash
# The Secrets the manifests mount, made with the project's own `keys new` (CURVE key pairs,
# docs/operations.md "Keys and authentication") and a fresh API key (docs/http-api.md):
#
#   deploy/kubernetes/make-secrets.sh DIR
#   kubectl apply -f DIR/secrets.yaml
#
# writes into DIR (keep it private, mode 0700):
#   keys/        broker, worker and client key pairs (kept: a second run reuses them)
#   api-key      the API key for your HTTP clients (Authorization: Bearer ...)
#   api_keys     its SHA-256 and owner, the broker's api.keys_file
#   secrets.yaml the Secrets fabric-broker-key, fabric-authorized-keys, fabric-worker-key,
#                fabric-api-keys, in namespace $NAMESPACE (default inference-fabric)
#
# Every DIR/keys/*.key is authorized: to let one more worker or client in, run
# `fabric keys new NAME --dir DIR/keys`, this script again and the apply; the broker sees the
# new key without a restart once the kubelet has updated the volume.
# FABRIC is how to run the command line: the install's `fabric` (default), or from a
# checkout FABRIC="python run.py", or the image:
#   FABRIC="docker run --rm -u $(id -u) -v $PWD/DIR:$PWD/DIR inference-fabric:0.1.0"
set -euo pipefail

dir=${1:?usage: make-secrets.sh DIR (then kubectl apply -f DIR/secrets.yaml)}
namespace=${NAMESPACE:-inference-fabric}
owner=${API_OWNER:-default}
read -r -a fabric <<< "${FABRIC:-fabric}"

umask 077
mkdir -p "$dir/keys"
for name in broker worker client; do
    if [ ! -e "$dir/keys/$name.key_secret" ]; then
        "${fabric[@]}" keys new "$name" --dir "$dir/keys" > /dev/null
    fi
done

sha256() {
    if command -v sha256sum > /dev/null; then sha256sum; else shasum -a 256; fi | cut -d' ' -f1
}
if [ ! -e "$dir/api-key" ]; then
    printf 'sk-fabric-%s' "$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')" > "$dir/api-key"
fi
printf '%s %s\n' "$(sha256 < "$dir/api-key")" "$owner" > "$dir/api_keys"

b64() { base64 < "$1" | tr -d '\n'; }
# secret NAME FILE...: one Secret whose data holds each FILE under its base name.
secret() {
    local name=$1 file
    shift
    printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n' \
        "$name" "$namespace"
    printf 'type: Opaque\ndata:\n'
    for file in "$@"; do
        printf '  %s: %s\n' "$(basename "$file")" "$(b64 "$file")"
    done
}

authorized=()
for file in "$dir"/keys/*.key; do
    [ "$(basename "$file")" = broker.key ] || authorized+=("$file")
done
{
    secret fabric-broker-key "$dir/keys/broker.key" "$dir/keys/broker.key_secret"
    secret fabric-authorized-keys "${authorized[@]}"
    secret fabric-worker-key "$dir/keys/worker.key_secret" "$dir/keys/broker.key"
    secret fabric-api-keys "$dir/api_keys"
} > "$dir/secrets.yaml"

echo "wrote $dir/secrets.yaml: kubectl apply -f $dir/secrets.yaml"
echo "clients: --key $dir/keys/client.key_secret --server-key $dir/keys/broker.key"
echo "the API key (Authorization: Bearer ...) is in $dir/api-key"
