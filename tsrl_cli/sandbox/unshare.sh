#!/bin/bash
# The `unshare` isolation's root. util-linux unshare runs this as root, with `bash -c` (unshare.py),
# in fresh mount, pid, net, IPC and UTS namespaces with the new pid namespace's /proc mounted.
# It builds the sandbox's root, enters it with chroot and runs the command there.
#
#   unshare.sh --workdir DIR [--root P]... [--link P TARGET]... [--ro-bind P]... [--mount HOST TARGET ro|rw]...
#              [--splice DIR]... [--stage-dir D]... [--stage-file F]... [--dir D]... [--file F]...
#              [--hide-dir D]... [--hide-file F]... -- COMMAND [ARG]...
#
# Every path is absolute; layout.py decides them (unshare.py turns its lists into these options):
#   --root P         a system directory shown read-only
#   --link P T       a system directory that is a symlink on the host (/bin -> usr/bin): the same symlink
#   --ro-bind P      a host directory shown read-only at its own path (this interpreter)
#   --mount H T M    host path H shown at target T, M = ro or rw
#   --splice A       a system directory rebuilt as a tmpfs of read-only binds of its entries
#   --stage-dir D    a directory made in the new root before anything is read-only
#   --stage-file F   an empty file made there (a file mount's mount point)
#   --dir D, --file F   the same, made later (a file only where missing), in a splice or a private tmpfs
#   --hide-dir D     a fresh tmpfs (1777) over D;  --hide-file F: /dev/null over F
# COMMAND runs in the working directory DIR (usually setpriv to the sandbox uid, then the command).
#
# Two phases. Outside (this shell, the host's tree in a private mount namespace): take handles (fds)
# on the host paths the new root will not contain (ro binds, mount sources, the working directory),
# then build the new root on a tmpfs over /tmp: binds of the system directories, /dev and /proc, and
# the directories mount points need. Inside (`inside`, in a bash chrooted there): every mount read-only,
# the splices, the private tmpfs and hidden files, the ro binds; then the read-write working directory
# and the mounts, through the handles; close the handles; run the command.
set -eu

workdir=
roots=() links=() link_targets=() ro_binds=() mount_hosts=() mount_targets=() mount_modes=() splices=()
stage_dirs=() stage_files=() dirs=() files=() hide_dirs=() hide_files=()
while [ "$1" != -- ]; do
  case $1 in
    --workdir) workdir=$2; shift 2 ;;
    --root) roots+=("$2"); shift 2 ;;
    --link) links+=("$2"); link_targets+=("$3"); shift 3 ;;
    --ro-bind) ro_binds+=("$2"); shift 2 ;;
    --mount) mount_hosts+=("$2"); mount_targets+=("$3"); mount_modes+=("$4"); shift 4 ;;
    --splice) splices+=("$2"); shift 2 ;;
    --stage-dir) stage_dirs+=("$2"); shift 2 ;;
    --stage-file) stage_files+=("$2"); shift 2 ;;
    --dir) dirs+=("$2"); shift 2 ;;
    --file) files+=("$2"); shift 2 ;;
    --hide-dir) hide_dirs+=("$2"); shift 2 ;;
    --hide-file) hide_files+=("$2"); shift 2 ;;
    *) echo "tsrl-unshare: unknown option $1" >&2; exit 125 ;;
  esac
done
shift  # "$@" is now the command

# rebind and inside run in the chrooted bash, from their `declare -f` text (below), never called here:
# shellcheck disable=SC2317
# rebind SRC DEST: each entry of directory SRC shown read-only in DEST (a symlink stays a symlink)
rebind() {
  local src=$1 dest=${2%/} p name
  shopt -s nullglob dotglob
  for p in "$src"/*; do
    name=${p##*/}
    if [ -L "$p" ]; then
      ln -s "$(readlink "$p")" "$dest/$name"
    elif [ -d "$p" ]; then
      mkdir "$dest/$name"; mount -c --rbind "$p" "$dest/$name"
    else
      touch "$dest/$name"; mount -c --bind "$p" "$dest/$name"
    fi
  done
  shopt -u nullglob dotglob
}

# shellcheck disable=SC2317
# The second phase, run by a bash chrooted in the new root; the first phase's variables (the lists
# and the handles) reach it as `declare -p` text. A handle is read as /proc/$$/fd/N: this shell's own.
inside() {
  set -eu
  local m a d f fd i splice_fds=()
  # Back to the working directory through its handle: its path has no parents in the new root until
  # it is bound at its own path below, so cd's getcwd warning here is expected and dropped.
  cd -P "/proc/$$/fd/$cwd_fd" 2>/dev/null
  # every mount read-only, the new root included (the cwd keeps a handle on the workdir)
  while read -r m; do
    case "$m" in /proc|/proc/*) continue ;; esac
    mount -o remount,bind,ro "$m" 2>/dev/null || true
  done < <(awk '{print $5}' /proc/self/mountinfo | sort -u)
  for a in "${splices[@]}"; do  # before the hidden paths, which then cover what the splices show again
    exec {fd}<"$a"
    splice_fds+=("$fd")
    mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$a"
    rebind "/proc/$$/fd/$fd" "$a"
  done
  for d in "${hide_dirs[@]}"; do mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$d"; done
  for f in "${hide_files[@]}"; do mount --bind /dev/null "$f"; done
  for i in "${!ro_binds[@]}"; do
    mkdir -p "${ro_binds[i]}"
    mount -c --bind "/proc/$$/fd/${ro_fds[i]}" "${ro_binds[i]}"
    mount -o remount,bind,ro "${ro_binds[i]}"
  done
  # -c: mount must not canonicalize ".", which now names the new empty directory
  mkdir -p "$workdir"; mount -c --bind . "$workdir"; mount -o remount,bind,rw "$workdir"
  for d in "${dirs[@]}"; do mkdir -p "$d"; done
  for f in "${files[@]}"; do [ -e "$f" ] || touch "$f"; done
  for i in "${!mount_targets[@]}"; do
    mount -c --bind "/proc/$$/fd/${mount_fds[i]}" "${mount_targets[i]}"
    mount -o remount,bind,"${mount_modes[i]}" "${mount_targets[i]}"
  done
  for a in "${splices[@]}"; do mount -o remount,ro "$a"; done
  cd "$workdir"
  ip link set lo up 2>/dev/null || true
  # no handle on a host path may reach the command: it would lead out of the new root
  for fd in "${ro_fds[@]}" "${mount_fds[@]}" "${splice_fds[@]}" "$cwd_fd"; do exec {fd}<&-; done
  set +e
  "$@"
  exit $?
}

mount --make-rprivate /
cd "$workdir"
ro_fds=() mount_fds=()
for p in "${ro_binds[@]}"; do exec {fd}<"$p"; ro_fds+=("$fd"); done
for p in "${mount_hosts[@]}"; do exec {fd}<"$p"; mount_fds+=("$fd"); done
# The chroot leaves the shell in /, so /proc/$$/cwd would not name the working directory (commands
# would run in the host's /): the chrooted shell gets back to it through this handle.
exec {cwd_fd}<.

stage=/tmp  # covered by the tmpfs that becomes the root
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$stage"
for p in "${roots[@]}"; do mkdir "$stage$p"; mount -c --rbind "$p" "$stage$p"; done
for i in "${!links[@]}"; do ln -s "${link_targets[i]}" "$stage${links[i]}"; done
for d in "${stage_dirs[@]}"; do mkdir -p "$stage$d"; done
for f in "${stage_files[@]}"; do touch "$stage$f"; done

cd /
inner=$(declare -p workdir ro_binds ro_fds mount_targets mount_modes mount_fds splices dirs files \
  hide_dirs hide_files cwd_fd; declare -f rebind inside)
set +e
# not exec: this shell stays pid 1 of the pid namespace, and the command must not be pid 1 (pid 1
# of a namespace ignores SIGXCPU, so the CPU-time limit would not fire)
chroot "$stage" /bin/bash --noprofile --norc -c "$inner"$'\n''inside "$@"' tsrl-unshare "$@"
exit $?
