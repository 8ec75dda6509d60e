#!/usr/bin/env python3
"""An AGLX client written from the protocol's prose description, independent of the Rust
crate: it builds frames by hand, counts CONTENT-LENGTH itself, signs with Python's hmac, and
talks to a running aglx-bridge.

usage: aglx_client.py TCP_HOST:PORT UDP_HOST:PORT KEY_FILE
Exits 0 when every check passed; prints what failed otherwise.
"""
import hashlib
import hmac
import json
import os
import socket
import sys
import time

TCP = sys.argv[1]
UDP = sys.argv[2]
KEY = open(sys.argv[3], "rb").read().rstrip(b"\r\n")


def addr(s):
    host, port = s.rsplit(":", 1)
    return host, int(port)


def frame(transport, headers, body=None):
    """Start line, NAME: value lines, blank line, JSON body; CRLF line ends."""
    lines = ["AGLX/1.0 " + transport]
    payload = b""
    if body is not None:
        payload = json.dumps(body).encode("utf-8")
        headers = headers + [("CONTENT-TYPE", "application/json"), ("CONTENT-LENGTH", str(len(payload)))]
    for name, value in headers:
        lines.append("%s: %s" % (name, value))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + payload


def signed(headers, body):
    """TIMESTAMP and NONCE in, then SIGNATURE last: HMAC-SHA256 of the frame without it."""
    headers = headers + [("TIMESTAMP", str(int(time.time()))), ("NONCE", os.urandom(16).hex())]
    unsigned = frame("TCP", headers, body)
    head, payload = unsigned.split(b"\r\n\r\n", 1)
    mac = hmac.new(KEY, unsigned, hashlib.sha256).hexdigest()
    return head + b"\r\nSIGNATURE: " + mac.encode() + b"\r\n\r\n" + payload


class Conn:
    def __init__(self, me, subscribe):
        self.sock = socket.create_connection(addr(TCP), timeout=10)
        self.buf = b""
        self.me = me
        self.send(frame("TCP", [("FROM", me), ("TYPE", "handshake")], {"subscribe": subscribe}))
        ack = self.read()
        check(ack["headers"].get("TYPE") == "handshake.ack", "handshake.ack expected, got %r" % ack)
        check(ack["headers"].get("STATUS") == "100", "STATUS 100 expected")

    def send(self, data):
        self.sock.sendall(data)

    def read(self):
        """One frame: header lines up to the blank line, then CONTENT-LENGTH bytes."""
        while b"\n\r\n" not in self.buf and b"\n\n" not in self.buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            self.buf += chunk
        i = self.buf.find(b"\r\n\r\n")
        head, rest = self.buf[:i], self.buf[i + 4:]
        lines = head.decode("utf-8").split("\r\n")
        check(lines[0] == "AGLX/1.0 TCP", "bad start line %r" % lines[0])
        headers = {}
        for line in lines[1:]:
            name, value = line.split(":", 1)
            headers[name.strip().upper()] = value.strip()
        n = int(headers.get("CONTENT-LENGTH", "0"))
        while len(rest) < n:
            chunk = self.sock.recv(4096)
            check(chunk, "connection closed inside a body")
            rest += chunk
        self.buf = rest[n:]
        body = json.loads(rest[:n]) if n else None
        return {"headers": headers, "body": body}


failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)
        raise SystemExit(1)


# Zone py.test has a key (KEY_FILE); zone open.test has none.

# 1. Two agents; alpha assigns a task to beta through the bridge.
beta = Conn("agent://beta.open.test", "own")
alpha = Conn("agent://alpha.open.test", "none")
task = {"task": "analyze.dataset", "priority": 3, "payload": {"dataset_url": "http://alpha.local/data/sample.csv"}}
alpha.send(frame("TCP", [("FROM", "agent://alpha.open.test"), ("TO", "agent://beta.open.test"), ("TYPE", "task.assign"), ("CREDITS", "2")], task))
answer = alpha.read()
check(answer["headers"].get("STATUS") == "200", "task.assign not accepted: %r" % answer)
got = beta.read()
check(got["headers"].get("TYPE") == "task.assign", "beta did not receive the task: %r" % got)
check(got["body"] == task, "task body changed in transit")
check(got["headers"].get("CREDITS") == "2", "credits lost")

# 2. Unknown recipient: 404, connection stays usable.
alpha.send(frame("TCP", [("FROM", "agent://alpha.open.test"), ("TO", "agent://nobody.open.test"), ("TYPE", "status.report")], {"state": "x"}))
check(alpha.read()["headers"].get("STATUS") == "404", "404 expected")

# 3. Zone py.test has a key: an unsigned task is refused with 401 and the connection closes.
gamma = Conn("agent://gamma.py.test", "none")
gamma.send(frame("TCP", [("FROM", "agent://gamma.py.test"), ("TO", "agent://beta.open.test"), ("TYPE", "task.result")], {"ok": True}))
check(gamma.read()["headers"].get("STATUS") == "401", "unsigned task.result must be refused")
check(gamma.read() is None, "connection must close after 401")

# 4. Signed with Python's own HMAC: accepted, and delivered to beta; the replay is refused.
delta = Conn("agent://delta.py.test", "none")
sframe = signed([("FROM", "agent://delta.py.test"), ("TO", "agent://beta.open.test"), ("TYPE", "task.result"), ("CREDITS", "7")], {"result": "done"})
delta.send(sframe)
check(delta.read()["headers"].get("STATUS") == "200", "signed frame refused")
check(beta.read()["headers"].get("TYPE") == "task.result", "beta did not receive the signed result")
delta.send(sframe)
check(delta.read()["headers"].get("STATUS") == "401", "replayed frame must be refused")

# 5. A malformed frame (wrong CONTENT-LENGTH sign) gets 400, then the connection closes.
eps = Conn("agent://eps.open.test", "none")
eps.send(b"AGLX/1.0 TCP\r\nFROM: agent://eps.open.test\r\nTYPE: status.report\r\nCONTENT-LENGTH: +2\r\n\r\n{}")
check(eps.read()["headers"].get("STATUS") == "400", "400 expected for a malformed frame")
check(eps.read() is None, "connection must close after 400")

# 6. UDP announce, then list the registry over TCP.
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ann = frame("UDP", [("FROM", "agent://exec.open.test"), ("TYPE", "agent.announce")],
            {"agent_name": "py-exec", "awcp_url": "http://127.0.0.1:7200/awcp", "transports": ["awcpfs"], "free_capacity": 1, "ttl_seconds": 60})
u.sendto(ann, addr(UDP))
# A task over UDP is refused, with an answer no larger than the datagram.
bad = frame("UDP", [("FROM", "agent://exec.open.test"), ("TYPE", "task.assign")], {"task": "no tasks over udp, please"})
u.sendto(bad, addr(UDP))
u.settimeout(5)
reply, _ = u.recvfrom(4096)
check(len(reply) <= len(bad), "UDP answer larger than the request")
check(b"STATUS: 400" in reply, "UDP refusal expected: %r" % reply)
found = False
for _ in range(50):
    alpha.send(frame("TCP", [("FROM", "agent://alpha.open.test"), ("TYPE", "registry.update")], {"op": "list"}))
    listing = alpha.read()
    agents = [a["agent"] for a in listing["body"]["agents"]]
    if "agent://exec.open.test" in agents:
        found = True
        break
    time.sleep(0.1)
check(found, "announced agent not in the registry")

print("python AGLX client: all checks passed")
