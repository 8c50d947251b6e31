"""The appliance's transport: its unix socket, the connections and their limits, the one select loop.

One thread, one ``select``: the socket and its connections, the runners' exits (SIGCHLD through
Python's wakeup fd), each runner's progress pipe and the params checkers' answers (both handed to
the service), and a half-second tick while anything is pending. It never spins (docs/design/appliance.md
"The service"). A connection carries one request line and gets JSON lines back until the server
half-closes it; what a peer sends after its request is read and dropped, so a refused request still
gets its answer. Lines over ``MAX_LINE`` are refused; a connection silent for ``IDLE_SECONDS``, or
not taking its reply for as long, is closed, as is one that shuts its side while waiting (a client
interrupted). ``MAX_CONNECTIONS`` at most, ``MAX_CONNECTIONS_PER_USER`` per user; out of
descriptors, it stops accepting for a second rather than spin. Who is asking is what the kernel
says of the peer (``SO_PEERCRED``), never a name in a request.
"""
import errno
import json
import os
import pwd
import selectors
import signal
import socket
import stat
import struct
import time

from pyapi.client import MAX_LINE, Client
from pyapi.errors import ApplianceError, ApplianceRunning

#: A connection that has not sent its request, or not taken its reply, within this many seconds is closed.
IDLE_SECONDS = 30.0
MAX_CONNECTIONS = 512
#: Connections one user may hold at once (a `wse logs -f` holds one): no user can lock the others out.
MAX_CONNECTIONS_PER_USER = 32
#: Seconds between looks at followed logs, waits and deadlines (only while there are any).
TICK_SECONDS = 0.5


class Conn:
    """One client's connection: who it is (``SO_PEERCRED``), its buffers, and what its reply waits on."""

    def __init__(self, sock):
        self.sock = sock
        self.pid, self.uid, self.gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                         struct.calcsize("3i")))
        self.inbuf, self.outbuf = b"", b""
        self.opened = self.sent = time.monotonic()  # sent: when its reply last moved
        self.answered = False       # its request has been read (it may be following a log or waiting)
        self.close_after = False    # half-close once outbuf is sent
        self.closed_at = None       # when it was half-closed (it is closed when the peer closes, or idles)
        self.follow = None          # (job id, offset, decoder, follow) while sending a log
        self.wait = None            # (job id, deadline) while waiting for a job to end
        self.check = None           # the params check of its submit (checker.Check), while it runs
        self.eof = False            # the peer has shut its side (it may still read)
        self.watched = False        # registered with the selector

    def pending(self):
        """Its reply waits on something of the service's: a params check, a log followed, a job's end."""
        return self.check is not None or self.follow is not None or self.wait is not None


def user_name(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def answering(socket_path):
    """The status of the appliance answering at ``socket_path``, or None if none does."""
    try:
        return Client(socket_path).status()
    except ApplianceError:
        return None


def listen(socket_path, owner):
    """The service's listening socket at ``socket_path`` (a socket a killed service left is replaced);
    ApplianceRunning if an appliance answers there."""
    try:
        mode = socket_path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise ApplianceError(f"{socket_path}: exists and is not a socket; choose another --socket")
        if answering(socket_path) is not None:
            raise ApplianceRunning(f"{socket_path}: an appliance already answers there")
        socket_path.unlink()  # left by a service that was killed
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(socket_path))
    # Root's appliance serves every user (each is told apart by the kernel, not by the request).
    os.chmod(socket_path, 0o666 if owner == 0 else 0o600)
    s.listen(64)
    s.setblocking(False)
    return s


class Server:
    """The loop and the connections. ``service`` is told what happens (``started``; ``handle``: a request
    line; ``read_check``: a checker's answer; ``ready``: a pipe of its own; ``tick_conn``: a pending
    connection's tick; ``end_check``: a connection gone mid-check; ``begin_stop``: a signal) and asked
    what remains (``done``, ``busy``, ``reap``, ``tick``, ``stopping``)."""

    def __init__(self, listener, service):
        self.listener, self.service = listener, service
        self.sel = selectors.DefaultSelector()
        self.conns = {}            # fd -> Conn
        self.accept_paused = None  # monotonic time to accept again after running out of descriptors

    def serve(self):
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries the signal number
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a client gone mid-reply is an OSError, not our end
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(wake_r, selectors.EVENT_READ, "signal")
        service, guarded = self.service, self.service.guarded
        service.started()
        while not service.done():
            busy = self.conns or service.busy() or self.accept_paused is not None
            for key, events in self.sel.select(TICK_SECONDS if busy else None):
                data = key.data
                if data == "accept":
                    self._accept()
                elif data == "signal":
                    for sig in os.read(wake_r, 512):
                        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                            service.begin_stop(f"signal {signal.Signals(sig).name}")
                elif isinstance(data, Conn) and data.check is not None and key.fd == data.check.fd:
                    guarded("a params check", service.read_check, data)
                elif isinstance(data, Conn):
                    if events & selectors.EVENT_READ:
                        guarded("a request", self._read, data)
                    if events & selectors.EVENT_WRITE and data.sock.fileno() in self.conns:
                        guarded("a reply", self.flush, data)
                else:
                    service.ready(data)
            service.reap()
            self.tick()
        for conn in list(self.conns.values()):
            self.flush(conn)
            self.close(conn)

    def stop_listening(self):
        if self.accept_paused is None:
            self.sel.unregister(self.listener)
        self.listener.close()

    def tick(self):
        now = time.monotonic()
        self.service.tick(now)
        if self.accept_paused is not None and now > self.accept_paused and not self.service.stopping:
            self.accept_paused = None
            self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        for conn in list(self.conns.values()):
            if conn.sock.fileno() not in self.conns:
                continue
            if conn.outbuf and now - conn.sent > IDLE_SECONDS:
                self.close(conn)  # it does not take its reply
            elif conn.pending():
                self.service.tick_conn(conn, now)
            elif now - (conn.closed_at or conn.opened) > IDLE_SECONDS and (conn.closed_at or not conn.answered):
                self.close(conn)
            elif conn.answered and not conn.close_after and now - conn.opened > IDLE_SECONDS:
                self.close(conn)  # answered, nothing pending, no reply coming (a failure was logged)

    # -- connections ---------------------------------------------------------------------------
    def _accept(self):
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # out of descriptors: wait a second, don't spin
                self.sel.unregister(self.listener)
                self.accept_paused = time.monotonic() + 1.0
            return
        if len(self.conns) >= MAX_CONNECTIONS:
            sock.close()
            return
        sock.setblocking(False)
        conn = Conn(sock)
        self.conns[sock.fileno()] = conn
        self.watch(conn)
        if sum(c.uid == conn.uid for c in self.conns.values()) > MAX_CONNECTIONS_PER_USER:
            conn.answered = True
            self.reply(conn, {"error": f"user {user_name(conn.uid)} has {MAX_CONNECTIONS_PER_USER} "
                                       "connections to the appliance open already"})

    def _read(self, conn):
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            if conn.answered and conn.closed_at is None and (conn.check or conn.outbuf):
                conn.eof = True  # it has said all it will say; its reply is still to come
                self.watch(conn)
            else:
                self.close(conn)
            return
        if conn.answered:
            return  # one request per connection: anything more is read and dropped
        conn.inbuf += chunk
        if b"\n" not in conn.inbuf:
            if len(conn.inbuf) > MAX_LINE:
                conn.answered, conn.inbuf = True, b""
                self.reply(conn, {"error": f"request longer than {MAX_LINE} bytes"})
            return
        line = conn.inbuf.split(b"\n", 1)[0]
        conn.answered, conn.inbuf = True, b""
        self.service.handle(conn, line)

    def is_open(self, conn):
        return conn.sock.fileno() in self.conns

    def send(self, conn, obj):
        if not conn.outbuf:
            conn.sent = time.monotonic()
        conn.outbuf += (json.dumps(obj) + "\n").encode()
        self.flush(conn)

    def reply(self, conn, obj):
        """The last reply: once sent, the connection is half-closed (see ``flush``)."""
        conn.close_after = True
        self.send(conn, obj)

    def flush(self, conn):
        if conn.closed_at is not None or conn.sock.fileno() not in self.conns:
            return
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[sent:]
                conn.sent = time.monotonic()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self.close(conn)
                return
        if conn.close_after and not conn.outbuf:
            # Half-close, and drop what the peer still sends until it closes: closing with unread
            # input would reset the connection and could lose the reply (a request too long, say).
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self.close(conn)
                return
            if conn.eof:
                self.close(conn)
                return
            conn.closed_at = time.monotonic()
        self.watch(conn)

    def watch(self, conn):
        """Select on what the connection may still do: send (unless it is at its end), take its reply."""
        events = (0 if conn.eof else selectors.EVENT_READ) | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events and conn.watched:
            self.sel.modify(conn.sock, events, conn)
        elif events:
            self.sel.register(conn.sock, events, conn)
        elif conn.watched:
            self.sel.unregister(conn.sock)
        conn.watched = bool(events)

    def close(self, conn):
        fd = conn.sock.fileno()
        if fd in self.conns:
            del self.conns[fd]
            if conn.watched:
                self.sel.unregister(conn.sock)
                conn.watched = False
        conn.sock.close()
        if conn.check is not None:  # closed for a fault or a timeout: nothing is queued
            self.service.end_check(conn)
