#!/usr/bin/env bash
# Builds fusekeeper's container images offline from Debian's own packages, here or on any Debian 12
# machine, as root:
#
#   bash scripts/build-images.sh            # fusekeeper/{agent,fkserve,webhook}:<version>
#
# 1. The Debian 12 base (debian:12 and debian:12-slim) is made with mmdebstrap from the Debian
#    mirror this machine uses, and put in the local container storage under the names the
#    Dockerfile pulls, so nothing comes from a registry.
# 2. The images are built from k8s/images/Dockerfile, unchanged (it builds with `docker build`
#    on a machine with internet too), with buildah. RUN steps use chroot isolation: no OCI
#    runtime or cgroup setup is needed. The host's Bazel disk cache is lent to the build stage,
#    so a machine that has built the tree does not compile it again.
# 3. Sizes and the build time are printed; `podman push` / `buildah push` publish them.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
version=$(sed -n 's/^#define FUSEKEEPER_VERSION_STRING "\(.*\)"/\1/p' agent/version.h)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
need=()
for p in mmdebstrap buildah podman; do command -v "$p" >/dev/null || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
start=$(date +%s)

# Debian's suites from this machine's own apt configuration (offline mirrors included).
mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
security=$(sed -n 's/^URIs: *\(http[^ ]*debian-security\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
mirror=${mirror:-http://deb.debian.org/debian}
security=${security:-http://deb.debian.org/debian-security}
base=$(mktemp -d /tmp/fusekeeper-images.XXXXXX)
trap 'rm -rf "$base"' EXIT
# As Debian's own images are made: the Essential packages and apt; apt keeps no package cache
# (docker-clean); and the slim variant
# leaves out documentation, manual pages and translations.
clean_apt=(--aptopt='Dir::Cache::pkgcache ""' --aptopt='Dir::Cache::srcpkgcache ""'
           --aptopt='DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; }'
           --aptopt='APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; }'
           --customize-hook='rm -rf "$1"/var/cache/apt/*.bin "$1"/var/lib/apt/lists/*')
slim=(--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
      --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*'
      --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/lintian/*')
make_base() {  # tag, extra mmdebstrap options...
  local tag=$1; shift
  if podman image exists "docker.io/library/debian:$tag"; then return; fi
  echo "making debian:$tag with mmdebstrap from $mirror"
  mmdebstrap --quiet --variant=apt --format=tar --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    "${clean_apt[@]}" "$@" \
    bookworm "$base/debian-$tag.tar" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" "deb $security bookworm-security main"
  podman import --quiet --change 'CMD ["/bin/bash"]' "$base/debian-$tag.tar" "docker.io/library/debian:$tag" >/dev/null
}
make_base 12
make_base 12-slim "${slim[@]}"

# The build stage's Bazel disk cache (.bazelrc) is this host's: FUSEKEEPER_BAZEL_CACHE to lend
# another directory (an empty one builds from scratch); FUSEKEEPER_IMAGE_NO_CACHE=1 also skips
# buildah's layer cache.
cache=${FUSEKEEPER_BAZEL_CACHE:-/root/.cache/fusekeeper-bazel-disk}
mkdir -p "$cache"
layers=(--layers)
[ "${FUSEKEEPER_IMAGE_NO_CACHE:-0}" = 1 ] && layers=(--no-cache)
for target in agent fkserve webhook; do
  echo "building fusekeeper/$target:$version"
  buildah bud --quiet --pull=never --isolation=chroot "${layers[@]}" \
    --volume "$cache:/root/.cache/fusekeeper-bazel-disk" \
    --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.revision="$revision" \
    --label org.opencontainers.image.source=https://github.com/fusekeeper/fusekeeper \
    --label org.opencontainers.image.title="fusekeeper $target" \
    -f k8s/images/Dockerfile --target "$target" -t "fusekeeper/$target:$version" . >/dev/null
done
echo "built in $(( $(date +%s) - start )) s:"
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^localhost/fusekeeper/' | sed 's/^localhost\///'
