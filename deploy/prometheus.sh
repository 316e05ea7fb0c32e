#!/bin/sh
# The compose stack's optional Prometheus (profile "monitoring"): writes its scrape config from
# the stack's addresses and ports, then runs Debian's prometheus. It scrapes the coordinator's
# /metrics (served by the ServerApp on MONITOR_PORT) and the patch store's (over TLS, trusting
# the deployment's CA). Usable outside compose too: `sh deploy/prometheus.sh` with the same env.
set -eu
CONFIG=${PROMETHEUS_CONFIG:-/tmp/fedrl-prometheus.yml}
cat > "$CONFIG" <<YAML
global:
  scrape_interval: ${SCRAPE_INTERVAL:-5s}
scrape_configs:
  - job_name: fedrl-coordinator
    static_configs:
      - targets: ["${COORDINATOR_ADDR:-superlink}:${MONITOR_PORT:-8787}"]
  - job_name: fedrl-patch-store
    scheme: ${STORE_SCHEME:-https}
    tls_config:
      ca_file: ${CA_FILE:-/certs/ca.pem}
    static_configs:
      - targets: ["${STORE_ADDR:-patch-store}:${STORE_PORT:-8800}"]
YAML
exec prometheus --config.file="$CONFIG" --storage.tsdb.path="${PROMETHEUS_DATA:-/var/lib/fedrl/prometheus}" \
  --web.listen-address="${BIND_HOST:-0.0.0.0}:${PROMETHEUS_PORT:-9090}"
