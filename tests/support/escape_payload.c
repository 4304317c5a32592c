/* Stands for code execution inside ggml-rpc-server after an exploit (issue 18's proof).
 *
 * Built by tests/integration/test_containment_real.py with the targets as -D defines; run as
 * `rpcguard serve -- payload ggml-rpc-server [ARGS]`. It tries each escape, prints one line per
 * attempt on stderr ("ESCAPE <name>: denied (<errno>)" or "ESCAPE <name>: ALLOWED ..."), then
 * execs the real server with the rest of its command line. The listening socket of the
 * "listen" attempt stays open across the exec, so the test can check from outside whether
 * it is reachable.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sched.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

/* OUTSIDE_PID: a process the test started outside the sandbox (a sleep); the other targets:
 * EXTERNAL_IP, LISTEN_PORT, SERVE_KEY, SERVE_CONFIG, OTHER_CACHE_FILE, OUTSIDE_FILE, USR_FILE (a path below /usr). */

#ifndef CONNECT_PORT
#error "-DCONNECT_PORT=<a port the test listens on, host loopback>"
#endif

static void report(const char *name, int ok, int err, const char *what) {
    if (ok)
        fprintf(stderr, "ESCAPE %s: ALLOWED %s\n", name, what);
    else
        fprintf(stderr, "ESCAPE %s: denied (%s)\n", name, strerror(err));
}

static void try_connect(const char *name, const char *ip, int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) { report(name, 0, errno, ""); return; }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, ip, &a.sin_addr);
    int rc = connect(s, (struct sockaddr *)&a, sizeof a);
    int err = errno;
    if (rc == 0) write(s, "ESCAPED\n", 8);
    report(name, rc == 0, err, "(connected)");
    close(s);
}

static void try_read(const char *name, const char *path) {
    char buf[64];
    int fd = open(path, O_RDONLY);
    int err = errno;
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf) : -1;
    if (fd >= 0 && n < 0) err = errno;
    report(name, fd >= 0 && n > 0, err, path);
    if (fd >= 0) close(fd);
}

static void try_write(const char *name, const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = errno;
    ssize_t n = fd >= 0 ? write(fd, "ESCAPED\n", 8) : -1;
    if (fd >= 0 && n < 0) err = errno;
    report(name, fd >= 0 && n == 8, err, path);
    if (fd >= 0) close(fd);
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: payload SERVER [ARGS]\n"); return 2; }
    try_connect("connect_loopback", "127.0.0.1", CONNECT_PORT);
    try_connect("connect_external", EXTERNAL_IP, 80);
    {   /* a listener of its own on every address, kept open across the exec */
        int s = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(LISTEN_PORT)};
        int rc = s < 0 ? -1 : bind(s, (struct sockaddr *)&a, sizeof a);
        if (rc == 0) rc = listen(s, 4);
        /* bound inside its own namespace it is not reachable: the test checks that from outside */
        fprintf(stderr, "ESCAPE listen_bind: %s\n", rc == 0 ? "bound (reachability checked by the test)" : strerror(errno));
    }
    try_read("read_serve_key", SERVE_KEY);
    try_read("read_serve_config", SERVE_CONFIG);
    try_read("read_other_cache", OTHER_CACHE_FILE);
    try_write("write_outside_cache", OUTSIDE_FILE);
    try_write("write_usr", USR_FILE);
    {
        int rc = kill(OUTSIDE_PID, 0);
        report("signal_outside", rc == 0, errno, "(kill 0 reached it)");
        long p = ptrace(PTRACE_ATTACH, OUTSIDE_PID, 0, 0);
        report("ptrace_outside", p == 0, errno, "(attached)");
        if (p == 0) ptrace(PTRACE_DETACH, OUTSIDE_PID, 0, 0);
    }
    {   /* the kernel's attack surface a server never needs: the syscall filter's business */
        int rc = unshare(CLONE_NEWUSER);
        report("unshare_userns", rc == 0, errno, "(a user namespace of its own)");
        char params[120] = {0};  /* struct io_uring_params */
        long ring = syscall(__NR_io_uring_setup, 1, params);
        report("io_uring", ring >= 0, errno, "(a ring)");
        if (ring >= 0) close((int)ring);
        long key = syscall(__NR_add_key, "user", "rpcguard-escape", "x", 1, -3 /* KEY_SPEC_SESSION_KEYRING */);
        report("keyring", key >= 0, errno, "(a key added)");
    }
    fflush(stderr);
    execv(argv[1], argv + 1);
    fprintf(stderr, "exec %s: %s\n", argv[1], strerror(errno));
    return 127;
}
