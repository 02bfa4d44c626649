# Sourced by the install scripts: installs the Debian packages of the commands this machine lacks, as root or
# with sudo, so that every script the README names works as written on a fresh Debian/Ubuntu machine. No service
# is started (policy-rc.d): the tests start their own containerd and prometheus, with their own configuration.
#   need_commands COMMAND[=PACKAGE] ...   e.g. need_commands promtool=prometheus npm /usr/lib/cni/bridge=containernetworking-plugins
need_commands() {
  local missing=() item
  for item in "$@"; do
    command -v "${item%%=*}" >/dev/null || missing+=("${item#*=}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "== installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  local had_policy=0
  [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ $had_policy = 1 ] || { printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null; $sudo chmod +x /usr/sbin/policy-rc.d; }
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ $had_policy = 1 ] || $sudo rm -f /usr/sbin/policy-rc.d
}
