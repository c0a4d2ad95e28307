#!/bin/sh
# Entrypoint of one engine of a primary/shadow pair sharing a GPU set (see
# examples/k8s/failover-pod.yaml). Both containers run this script; the
# failover lock on the shared emptyDir decides which engine serves.
#
#   ENGINE_ID           0 = may be primary, >= 1 = shadow (read by ftctl)
#   FAILOVER_LOCK_PATH  the lock file on the shared volume (read by ftctl)
#   ENGINE_PORT         the engine's HTTP port
#   HEALTH_PORT         this wrapper's health port (readiness probe)
#
# `ftctl failover run` starts the engine, waits for /health, puts it to sleep
# (STANDBY: weights offloaded, GPU memory free for the active engine), blocks
# on the lock, wakes it (/wake_up) and serves (ACTIVE). If the engine dies,
# ftctl exits non-zero and the kernel hands the lock to the other container
# at once. Use `ftctl lock acquire -- CMD` instead for engines without sleep
# mode: CMD then starts only once the lock is held.
set -eu

: "${ENGINE_ID:?set ENGINE_ID (0 primary, 1 shadow)}"
: "${FAILOVER_LOCK_PATH:=/shared/failover.lock}"
: "${ENGINE_PORT:=8000}"
: "${HEALTH_PORT:=8081}"
: "${MODEL:=meta-llama/Llama-3.1-8B-Instruct}"
# vLLM serves /sleep, /wake_up and /is_sleeping only in its dev mode: without it the
# shadow cannot sleep, and `failover run` would stop it and start it cold on takeover.
VLLM_SERVER_DEV_MODE=1
export ENGINE_ID FAILOVER_LOCK_PATH VLLM_SERVER_DEV_MODE

exec ftctl failover run \
    --health-port "$HEALTH_PORT" --health-host 0.0.0.0 \
    --engine-url "http://127.0.0.1:$ENGINE_PORT" --wake-timeout 30 \
    -- vllm serve "$MODEL" --port "$ENGINE_PORT" --enable-sleep-mode \
       --gpu-memory-utilization 0.45
