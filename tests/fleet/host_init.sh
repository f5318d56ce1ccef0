#!/bin/sh
# First process (PID 1) of one simulated box's PID/mount/UTS/cgroup namespaces, started by fleet.py through
# `unshare`. It builds the box's private view of the filesystem, then becomes the box's sshd. Any failure stops
# it before sshd listens; fleet.py then reports this host's log (stdout/stderr of this script and of sshd).
#
# Inputs (environment, set by fleet.py; no value is ever evaluated as shell code):
#   RGT_HOSTNAME  RGT_GPU_COUNT  RGT_SSHD_CONFIG  RGT_PROFILE  RGT_DMESG  RGT_JOURNALCTL
#   RGT_DATA_MOUNT (size_mib:inodes)  RGT_DURABLE_MOUNT (size_mib:inodes)
#   RGT_MOUNTS   colon-separated absolute paths that get a private tmpfs each (the size of /data), empty for none
#   RGT_KEEP     colon-separated directories that the masks below hide but the box must still see
#                (the fleet's state dir, the checkout, the simulator and its python when under /tmp or /root)
#   RGT_CGROUP_MEMORY  "1" when fleet.py put this box in its own memory cgroup
set -eu
set -f  # paths are data: no globbing of RGT_KEEP entries

stash=/run/rgt-stash

private_tmpfs() {  # private_tmpfs DIR MODE [more mount options]
    mkdir -p "$1"
    mount -t tmpfs -o "mode=$2${3:+,$3}" tmpfs "$1"
}

sized_tmpfs() {  # sized_tmpfs DIR SIZE_MIB:INODES
    private_tmpfs "$1" 755 "size=${2%%:*}m,nr_inodes=${2##*:}"
}

hostname "$RGT_HOSTNAME"

# A private /run first: it also holds the stash of everything the masks below are about to hide.
private_tmpfs /run 755 size=16m
mkdir -p "$stash/dev"
mount --bind /dev "$stash/dev"
count=0
IFS=:
for keep in $RGT_KEEP; do
    count=$((count + 1))
    mkdir -p "$stash/$count"
    mount --bind "$keep" "$stash/$count"
done
unset IFS

# /dev: the usual character devices, a private pty instance and shm, and the GPU nodes of the scenario.
private_tmpfs /dev 755 size=1m,nosuid
for node in null zero full random urandom tty; do
    : >"/dev/$node"
    mount --bind "$stash/dev/$node" "/dev/$node"
done
mkdir /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts /dev/pts
ln -s pts/ptmx /dev/ptmx
mount -t tmpfs -o mode=1777,size=64m tmpfs /dev/shm
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
index=0
while [ "$index" -lt "$RGT_GPU_COUNT" ]; do
    : >"/dev/nvidia$index"
    chmod 666 "/dev/nvidia$index"
    index=$((index + 1))
done
for node in nvidiactl nvidia-uvm nvidia-uvm-tools; do
    : >"/dev/$node"
    chmod 666 "/dev/$node"
done

# Scratch space of its own, like a container: nothing here is shared with another box or with this machine.
private_tmpfs /tmp 1777 size=1g
private_tmpfs /var/tmp 1777 size=256m
private_tmpfs /root 700 size=256m
sized_tmpfs /data "$RGT_DATA_MOUNT"
sized_tmpfs /durable "$RGT_DURABLE_MOUNT"
# A platform profile's own directories (/workspace, /lambda/nfs/persistent), each a filesystem of its own.
IFS=:
for extra in $RGT_MOUNTS; do
    sized_tmpfs "$extra" "$RGT_DATA_MOUNT"
done
unset IFS

# The box sees its own memory cgroup as the root of the hierarchy (the cgroup namespace starts there).
if [ "${RGT_CGROUP_MEMORY:-}" = 1 ]; then
    private_tmpfs /sys/fs/cgroup 755 size=64k
    mkdir /sys/fs/cgroup/memory
    mount -t cgroup -o memory,nosuid,nodev,noexec cgroup /sys/fs/cgroup/memory
fi

# Bring back what must stay visible, then drop the stash.
count=0
IFS=:
for keep in $RGT_KEEP; do
    count=$((count + 1))
    mkdir -p "$keep"
    mount --bind "$stash/$count" "$keep"
    umount "$stash/$count"
    rmdir "$stash/$count"
done
unset IFS
umount "$stash/dev"
rmdir "$stash/dev" "$stash"

# A rented container has no readable kernel log unless the scenario says so: the simulator answers instead,
# also for callers that use absolute paths.
mount --bind "$RGT_DMESG" /usr/bin/dmesg
if [ -e /usr/bin/journalctl ]; then
    mount --bind "$RGT_JOURNALCTL" /usr/bin/journalctl
fi

# No .bashrc (this machine's runs `pyenv init`, +150 ms per command); login shells get the simulator PATH back
# after /etc/profile resets it.
: >/root/.bashrc
cp "$RGT_PROFILE" /root/.profile

mkdir -p /run/sshd
chmod 755 /run/sshd
exec /usr/sbin/sshd -D -e -f "$RGT_SSHD_CONFIG"
