"""Bring up `lo` in a fresh network namespace, then exec the rest of argv.

`unshare --net` gives a namespace whose only interface, loopback, is down; `ip` may not
be installed, so the flag is set here with the same ioctl it uses.
"""

import fcntl
import os
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def main() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
    os.execv(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
