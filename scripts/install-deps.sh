#!/usr/bin/env bash
# Installs every build, test and demo dependency of Troupe from Debian packages.
# Idempotent: when everything is present it only checks (a second or two) and exits.
# Usage: scripts/install-deps.sh   (as root, or with sudo available)
set -euo pipefail

pkgs=(
  build-essential cmake ninja-build pkgconf git clang-format
  libzmq3-dev cppzmq-dev libsodium-dev
  capnproto libcapnp-dev
  libgloo-dev libhiredis-dev
  libspdlog-dev libfmt-dev
  libtomlplusplus-dev libcli11-dev nlohmann-json3-dev
  libpcre2-dev libutf8proc-dev libzstd-dev zlib1g-dev
  libsqlite3-dev libxxhash-dev
  prometheus-cpp-dev prometheus nftables
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libibverbs-dev rdma-core
  python3-torch python3-numpy python3-matplotlib
  procps psmisc
  slurmd slurmctld slurm-client munge
)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#pkgs[@]} Debian packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "install-deps: installing ${#missing[@]} packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: done"
