#!/usr/bin/env bash
# The compose stack, for real, on this machine: starts Docker if needed, builds the image on a
# Debian base made with debootstrap (no image registry is reachable here), makes certificates,
# brings up docker-compose.yml with deploy/compose.host.yml (every service on 127.0.0.1 with
# its own port: container bridge networks use addresses that are off-limits here), scales the
# SuperNodes to NODES, waits for the one-shot submitter, checks the run's summary and what the
# optional Prometheus (profile "monitoring") scraped from the coordinator and the store, tears down.
# VOLUNTEERS=V (of the NODES): the profile "volunteers" too, NODES - V SuperNodes, and V volunteers
# who join from this host with the invite the stack wrote (`fedrl volunteer join`, which must be
# on PATH) and withdraw with Ctrl-C once the run is over.
# Needs root (Docker). Elsewhere, users run plain `docker compose up` with the default base.
set -euo pipefail
cd "$(dirname "$0")/.."

NODES=${NODES:-3}
VOLUNTEERS=${VOLUNTEERS:-0}
SUPERNODES=$(( NODES - VOLUNTEERS ))
[ "$VOLUNTEERS" -ge 0 ] && [ "$SUPERNODES" -ge 0 ] || { echo "VOLUNTEERS must be 0 to NODES ($NODES), got $VOLUNTEERS" >&2; exit 2; }
PROJECT=${PROJECT:-fedrlcompose}
BASE=${BASE:-fedrl-base:bookworm}
ROOTFS=${ROOTFS:-/var/tmp/fedrl-rootfs}
RUN_CONFIG=${RUN_CONFIG:-"versions=4 base-steps=2 max-steps=3 prompts=4 samples=4 buffer-size=2 eval-every=2"}
say() { printf '\n== %s\n' "$*"; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

say "Docker"
if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose
  fi
  (nohup dockerd >/var/log/fedrl-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info --format 'engine {{.ServerVersion}}, storage {{.Driver}}'
docker-compose version --short

say "base image $BASE"
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { apt-get update -q && apt-get install -y -q debootstrap; }
  [ -x "$ROOTFS/usr/bin/python3" ] || debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$ROOTFS"
  cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"  # pip reaches the registry
  tar -C "$ROOTFS" -c . | docker import - "$BASE"
fi

say "image fedrl:compose-test"
# the local CPU build of torch, when this machine has one: no CUDA packages in the image
cp /opt/wheels/torch-2.13.0*.whl .wheels/ 2>/dev/null || true
docker build --network host -t fedrl:compose-test \
  --build-arg BASE_IMAGE="$BASE" --build-arg PIP_CONSTRAINTS=constraints.txt . | tail -n 3
docker build --network host -t fedrl-prometheus:compose-test -f deploy/prometheus.Dockerfile \
  --build-arg BASE_IMAGE="$BASE" . | tail -n 1

WORK=$(mktemp -d)
NODE_THREADS=$(( $(nproc) / NODES > 0 ? $(nproc) / NODES : 1 ))  # the nodes share this host's cores
export FEDRL_TAG=compose-test FEDRL_CERTS="$WORK/certs" NODES NODE_THREADS RUN_CONFIG RUN_TIMEOUT=900
export BIND_HOST=127.0.0.1 SUPERLINK_ADDR=127.0.0.1 STORE_ADDR=127.0.0.1 COORDINATOR_ADDR=127.0.0.1
export PUBLIC_HOST=127.0.0.1 FEDRL_INVITES="$WORK/invites"  # the volunteers' invite
PROFILES=(--profile monitoring)
[ "$VOLUNTEERS" -gt 0 ] && PROFILES+=(--profile volunteers)
SUPERLINK_PORT=$(free_port) STORE_PORT=$(free_port) MONITOR_PORT=$(free_port) PROMETHEUS_PORT=$(free_port)
export SUPERLINK_PORT STORE_PORT MONITOR_PORT PROMETHEUS_PORT SCRAPE_INTERVAL=1s
export SUPERLINK_PUBLISH=$SUPERLINK_PORT STORE_PUBLISH=$STORE_PORT
# docker-compose 1.29 refuses published ports on host-networked services and cannot remove a
# key in an override file: render the merged config and drop `ports` where the network is the host's
docker-compose -p "$PROJECT" -f docker-compose.yml -f deploy/compose.host.yml "${PROFILES[@]}" config \
  | docker run --rm -i fedrl:compose-test python3 -c 'import sys, yaml
c = yaml.safe_load(sys.stdin)
for s in c["services"].values():
    if s.get("network_mode") == "host":
        s.pop("ports", None)
yaml.safe_dump(c, sys.stdout)' > "$WORK/compose.yml"
compose() { docker-compose -p "$PROJECT" -f "$WORK/compose.yml" "${PROFILES[@]}" "$@"; }
VOLUNTEER_PIDS=()
cleanup() {
  say "teardown"
  for pid in "${VOLUNTEER_PIDS[@]}"; do kill -9 -- "-$pid" 2>/dev/null || true; done
  compose down -v --remove-orphans 2>&1 | tail -n 2 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

say "certificates (fedrl certs, inside the image)"
docker run --rm --network host -v "$WORK:/out" fedrl:compose-test \
  fedrl certs --dir /out/certs --hosts 127.0.0.1 localhost superlink patch-store >/dev/null
ls "$WORK/certs"

say "up: patch store :$STORE_PORT, SuperLink :$SUPERLINK_PORT (metrics :$MONITOR_PORT), $SUPERNODES SuperNodes, submitter, Prometheus :$PROMETHEUS_PORT"
compose up -d --no-build --scale supernode="$SUPERNODES" 2>&1 | grep -v "^Creating volume" || true
compose ps

if [ "$VOLUNTEERS" -gt 0 ]; then
  say "$VOLUNTEERS volunteers join from this host"
  for _ in $(seq 120); do [ -s "$FEDRL_INVITES/invite.txt" ] && break; sleep 1; done
  [ -s "$FEDRL_INVITES/invite.txt" ] || { echo "the invite service wrote no invite:"; compose logs --no-color invite | tail -n 20; exit 1; }
  for i in $(seq "$VOLUNTEERS"); do  # each in a session of its own: Ctrl-C reaches it alone
    setsid fedrl volunteer join "$FEDRL_INVITES/invite.txt" --home "$WORK/volunteer-$i" --max-cpu "$NODE_THREADS" \
      >"$WORK/volunteer-$i.log" 2>&1 &
    VOLUNTEER_PIDS+=("$!")
  done
fi

say "waiting for the submitter (run config: $RUN_CONFIG)"
SUBMIT=$(compose ps -q submit)
CODE=$(timeout 1200 docker wait "$SUBMIT")
docker logs "$SUBMIT" 2>&1 | tail -n 6
compose logs --no-color patch-store 2>&1 | grep -c "refused" | sed 's/^/store refusals logged: /' || true
WARM=$(compose logs --no-color supernode 2>&1 | grep -c "warm ClientApp launcher ready" || true)
echo "warm ClientApp launchers ready: $WARM of $SUPERNODES SuperNodes"
compose ps
for i in "${!VOLUNTEER_PIDS[@]}"; do  # the run is over: each withdraws with Ctrl-C, and must exit 0
  pid=${VOLUNTEER_PIDS[$i]} n=$((i + 1))
  home="$WORK/volunteer-$n" log="$WORK/volunteer-$n.log"
  kill -INT "$pid"
  (sleep 120; kill -9 -- "-$pid") >/dev/null 2>&1 & watchdog=$!  # a withdrawal that hangs fails, killed
  rc=0; wait "$pid" || rc=$?
  kill "$watchdog" 2>/dev/null || true
  grep -E "as node|left the federation" "$log" | tail -n 2 | sed "s/^/volunteer $n: /"
  [ "$rc" -eq 0 ] && grep -q "left the federation cleanly" "$log" \
    || { echo "volunteer $n exited with $rc:"; tail -n 20 "$log"; exit 1; }
  status=$(fedrl volunteer status --home "$home")  # it trained: rounds done
  grep -E "^  (rounds|ledger):" <<<"$status" | sed "s/^ /volunteer $n:/"
  grep -Eq "^  rounds: [1-9]" <<<"$status" || { echo "volunteer $n did no round: $status"; exit 1; }
done
VOLUNTEER_PIDS=()

SUMMARY=$(docker logs "$SUBMIT" 2>&1 | grep '"final_eval"' | tail -n 1)
python3 - "$CODE" "$SUMMARY" "$NODES" "$PROMETHEUS_PORT" "$WARM" "$SUPERNODES" <<'EOF'
import json, sys, urllib.parse, urllib.request
code, line, nodes, prometheus, warm, supernodes = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
assert code == 0, f"the submitter exited with {code}"
assert warm == supernodes, f"{warm} of {supernodes} SuperNodes' warm ClientApp launchers became ready (fedrl deploy node starts one)"
s = json.loads(line)
assert s["versions"] >= 1 and s["counts"]["accepted"] >= nodes, s
assert s["final_eval"] < s["initial_eval"], f"held-out error did not fall: {s['initial_eval']} -> {s['final_eval']}"
print(f"compose run OK: held-out error {s['initial_eval']:.3f} -> {s['final_eval']:.3f} in {s['versions']} versions, "
      f"{s['counts']['accepted']} accepted updates, {s['bytes_up'] + s['bytes_down']} bytes moved")

def query(q):  # what Prometheus kept of the run (the coordinator's monitor closed with it)
    url = f"http://127.0.0.1:{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    return {r["metric"].get("job", ""): float(r["value"][1]) for r in json.load(urllib.request.urlopen(url))["data"]["result"]}
version = query("max_over_time(fedrl_version[30m])").get("fedrl-coordinator", 0)
accepted = query("max_over_time(fedrl_accepted_total[30m])").get("fedrl-coordinator", 0)
store = query("sum by (job) (max_over_time(fedrl_store_requests_total[30m]))").get("fedrl-patch-store", 0)
assert version >= s["versions"] - 1 and accepted >= nodes and store > 0, (version, accepted, store)
print(f"Prometheus scraped the coordinator (version {version:g}, {accepted:g} accepted) and the store ({store:g} requests)")
EOF
