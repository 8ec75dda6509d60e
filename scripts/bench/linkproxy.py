#!/usr/bin/env python3
"""A userspace TCP proxy that emulates a network link: round-trip delay and bandwidth.

    python3 linkproxy.py --listen 127.0.0.1:0 --target 127.0.0.1:3101 \
        --rtt-ms 20 --mbit 200 --port-file PORTFILE

Every byte read from one side is delivered to the other side after the link's one-way
delay (half of --rtt-ms), and no sooner than the link could have carried it: each
direction is one shared link of --mbit Mbit/s (a FIFO: all connections through this proxy
queue behind each other, as on a real link), so a background stream slows an interactive
request down here just as it would between two machines. Reading from a socket is paced
to the link's rate, so a fast sender is held back by TCP flow control rather than by an
ever-growing buffer in this process.

Used by scripts/bench.sh (--link-delay-ms, --link-mbit) where the kernel has no `netem`
(tc qdisc) or where shaping loopback would slow every other process down too. Needs only
Python 3.8+. Writes the port it listens on to --port-file once it accepts connections.
"""

import argparse
import asyncio
import os
import socket
import sys

CHUNK = 64 * 1024


class Link:
    """One direction of the emulated link: serialisation at `rate` bytes/s, then `delay` s."""

    def __init__(self, rate_bps, delay_s):
        self.rate = rate_bps
        self.delay = delay_s
        self.next_free = 0.0

    def schedule(self, now, nbytes):
        """When `nbytes` handed to the link at `now` have been sent (serialised) onto it."""
        start = max(now, self.next_free)
        end = start + (nbytes / self.rate if self.rate else 0.0)
        self.next_free = end
        return end


async def pump(reader, writer, link, loop):
    """Copy reader -> writer through `link`, keeping byte order; half-close at the end."""
    last_due = 0.0
    try:
        while True:
            data = await reader.read(CHUNK)
            now = loop.time()
            sent = link.schedule(now, len(data)) if data else max(now, link.next_free)
            # Strictly increasing: the event loop's timer heap does not order equal times.
            due = max(sent + link.delay, last_due + 1e-6)
            last_due = due
            if not data:
                loop.call_at(due, _eof, writer)
                return
            loop.call_at(due, _write, writer, data)
            # Pace reading to the link: don't read more before this chunk left the "wire".
            if sent > now:
                await asyncio.sleep(sent - now)
    except (ConnectionError, OSError):
        loop.call_at(max(loop.time() + link.delay, last_due + 1e-6), _close, writer)


def _write(writer, data):
    if not writer.is_closing():
        writer.write(data)


def _eof(writer):
    if writer.is_closing():
        return
    try:
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (ConnectionError, OSError):
        writer.close()


def _close(writer):
    if not writer.is_closing():
        writer.close()


async def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept on")
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--rtt-ms", type=float, default=0.0,
                    help="round-trip delay in ms; each direction gets half of it")
    ap.add_argument("--mbit", type=float, default=0.0,
                    help="bandwidth of each direction in Mbit/s (0: unlimited)")
    ap.add_argument("--port-file", help="write the listening port here once ready")
    a = ap.parse_args()
    if a.rtt_ms < 0 or a.mbit < 0:
        sys.exit("linkproxy: --rtt-ms and --mbit must not be negative")
    lhost, lport = a.listen.rsplit(":", 1)
    thost, tport = a.target.rsplit(":", 1)
    rate = a.mbit * 1e6 / 8
    up = Link(rate, a.rtt_ms / 2000.0)     # client -> target
    down = Link(rate, a.rtt_ms / 2000.0)   # target -> client
    loop = asyncio.get_running_loop()

    async def handle(creader, cwriter):
        try:
            treader, twriter = await asyncio.open_connection(thost, int(tport))
        except OSError:
            cwriter.close()
            return
        for w in (cwriter, twriter):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The connection handshake itself costs a round trip on a real link.
        await asyncio.sleep(up.delay + down.delay)
        await asyncio.gather(pump(creader, twriter, up, loop),
                             pump(treader, cwriter, down, loop))

    server = await asyncio.start_server(handle, lhost, int(lport))
    port = server.sockets[0].getsockname()[1]
    if a.port_file:
        tmp = a.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, a.port_file)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
