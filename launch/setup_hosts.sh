#!/usr/bin/env bash
# Install what the several-hosts tests need (tests/nethosts.py): Debian's openssh-server and iproute2; and the
# etcd server the replicated-store tests run (tests/etcd_cluster.py; Debian's etcd-server).
#
#   sudo bash launch/setup_hosts.sh      # as root; .ci/run calls it before the tests
#
# The tests make hosts as network namespaces and run an sshd in each; they need root, `ip`, `tc` and
# /usr/sbin/sshd. Without root, or without apt-get, this script says so and changes nothing (those tests
# then skip and say why). The system's ssh and etcd services are not started: each test runs its own.
set -euo pipefail

NEED=()
[ -x /usr/sbin/sshd ] || NEED+=(openssh-server)
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || NEED+=(iproute2)
command -v ssh-keygen >/dev/null 2>&1 || NEED+=(openssh-client)
command -v etcd >/dev/null 2>&1 || NEED+=(etcd-server)
if [ ${#NEED[@]} -eq 0 ]; then
  echo "setup_hosts: openssh-server, openssh-client, iproute2 and etcd-server present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_hosts: missing ${NEED[*]}; not root or no apt-get, installing nothing (the several-hosts tests will skip)"
  exit 0
fi
echo "setup_hosts: installing ${NEED[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# policy-rc.d 101: the packages' maintainer scripts must not start the system's sshd or etcd
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get install -y -qq --no-install-recommends "${NEED[@]}"
