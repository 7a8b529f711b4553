#!/usr/bin/env bash
# A Debian base image without Docker Hub: debootstrap a minimal bookworm with python3 and its venv
# module, then `docker import` it. Needs root, debootstrap and a Debian mirror.
#   docker/make-base-image.sh [IMAGE_TAG] [MIRROR]      (default fedpower-base:bookworm)
set -euo pipefail
TAG=${1:-fedpower-base:bookworm}
MIRROR=${2:-http://deb.debian.org/debian}
ROOTFS=$(mktemp -d /tmp/fedpower-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
# mktemp -d makes the directory 0700, and `tar -C "$ROOTFS" -c .` records "." with that mode: the
# image's / would be drwx------ and its non-root user could not reach /bin. / is 0755.
chmod 0755 "$ROOTFS"
echo "make-base-image: debootstrap bookworm -> $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR" >/dev/null
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import - "$TAG" >/dev/null
echo "make-base-image: $TAG ($(docker image inspect -f '{{.Size}}' "$TAG") bytes)"
