#!/usr/bin/env bash
# Router overhead over loopback: wrk against one worker directly, then through `kvroute
# serve`, with the worker's engine sped up so far that it adds next to nothing. Prints wrk's
# latency distribution and requests/s for both, and the router's CPU per request.
# Needs: wrk (Debian), nats-server on PATH (scripts/test installs it into .venv), release
# binaries (cargo build --release --workspace --bins).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}/release
DUR=${DUR:-10s}; CONN=${CONN:-32}
store=$(mktemp -d)
nats-server -js -a 127.0.0.1 -p 14333 -sd "$store" >/dev/null 2>&1 & nats=$!
sleep 0.5
"$T/kvroute-worker" --nats nats://127.0.0.1:14333 --port 19333 --id 1 --speedup 1000000 >/dev/null 2>&1 & worker=$!
"$T/kvroute" serve --nats nats://127.0.0.1:14333 --port 18333 --host 127.0.0.1 >/dev/null 2>&1 & router=$!
trap 'kill $router $worker $nats 2>/dev/null; rm -rf "$store"' EXIT
for _ in $(seq 100); do curl -sf localhost:18333/ready >/dev/null && break; sleep 0.1; done
echo "== direct to the worker"
BODY='{"token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18],"max_tokens":1}' \
  wrk -t1 -c"$CONN" -d"$DUR" --latency -s bench/wrk/post.lua http://127.0.0.1:19333/internal/generate
ticks() { awk '{print $14 + $15}' /proc/$router/stat; }
before=$(ticks)
echo "== through the router"
out=$(BODY='{"model":"kvroute-sim","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18],"max_tokens":1}' \
  wrk -t1 -c"$CONN" -d"$DUR" --latency -s bench/wrk/post.lua http://127.0.0.1:18333/v1/completions)
echo "$out"
after=$(ticks)
requests=$(echo "$out" | awk '/requests in/ {print $1}')
hz=$(getconf CLK_TCK)
echo "router CPU: $(( (after - before) * 1000000 / hz / requests )) µs per request ($((after - before)) ticks, $requests requests)"
