#!/usr/bin/env bash
# Podman and its helpers from Debian's archive, for `make compose-check` on a machine without a
# Docker daemon (run as root; docs/deployment.md, "Checking the images and the stack").
# podman-compose comes from the dev requirements (.venv): Debian's 1.0.3 cannot read `!reset`.
set -euo pipefail
apt-get update
apt-get install -y --no-install-recommends podman buildah runc crun fuse-overlayfs slirp4netns \
  passt debootstrap uidmap conmon catatonit golang-github-containers-common netavark \
  aardvark-dns iptables containernetworking-plugins
# Containers get the limits this root may set (without CAP_SYS_RESOURCE podman's defaults fail
# with `setrlimit ... Operation not permitted`), and runc, which accepts hybrid cgroups (crun
# refuses them). An existing containers.conf is left as it is.
# (nproc: 32768 worked where this root's own hard limit was refused.)
conf=/etc/containers/containers.conf
nofile=$(ulimit -Hn)
nproc=$(ulimit -Hu); [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768
if [ ! -e "$conf" ]; then
  cat > "$conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
CONF
  echo "wrote $conf"
fi
podman --version
