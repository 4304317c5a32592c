/* Stands for code execution inside a contained ggml-rpc-server that goes for the sandbox's
 * limits, not out of it (issue 28 item 5): built by tests/integration/test_sandbox_limits_real.py
 * with -DMODE=<n> and run as `rpcguard serve -- payload ggml-rpc-server [ARGS]`. It does one
 * thing, reports on stderr as "LIMIT <mode>: ..." lines, and execs the real server with the rest
 * of its command line (so the session is a real one):
 *
 *   MODE_FORKS   fork children (each waits) until fork fails or MAX_FORKS: "LIMIT forks: N (errno)";
 *                then they are killed and reaped, and the server starts.
 *   MODE_MEMORY  CHILDREN children each touch CHILD_MIB MiB and wait; once each has either
 *                reported or died, those still alive hold their memory at the same time:
 *                "LIMIT memory: held X MiB in K processes at once (D died)".
 *   MODE_CACHE   a child waits for the session (an ESTABLISHED socket in the sandbox's network
 *                namespace), then writes FILE_MIB MiB files into /cache every 100 ms up to
 *                TOTAL_MIB: "LIMIT cache: wrote X MiB" per file, "LIMIT cache: done" at the end.
 *   MODE_FLOOD   writes FLOOD_LINES lines "FLOOD n" to stderr before the server starts (so a
 *                server that listens has had all of them read), then "LIMIT flood: done".
 *   MODE_DAEMON  a daemon (double fork, setsid: no parent-death signal of its own) that sleeps:
 *                "LIMIT daemon: started pid N".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MODE_FORKS 1
#define MODE_MEMORY 2
#define MODE_CACHE 3
#define MODE_FLOOD 4
#define MODE_DAEMON 5
#ifndef MODE
#error "-DMODE=1..4"
#endif
#ifndef MAX_FORKS
#define MAX_FORKS 2000
#endif
#ifndef CHILDREN
#define CHILDREN 8
#endif
#ifndef CHILD_MIB
#define CHILD_MIB 64
#endif
#ifndef FILE_MIB
#define FILE_MIB 4
#endif
#ifndef TOTAL_MIB
#define TOTAL_MIB 128
#endif
#ifndef FLOOD_LINES
#define FLOOD_LINES 200000
#endif

static void nap_ms(int ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static void forks(void) {
    static pid_t kids[MAX_FORKS];
    int n = 0, err = 0;
    for (; n < MAX_FORKS; n++) {
        pid_t p = fork();
        if (p < 0) { err = errno; break; }
        if (p == 0) { pause(); _exit(0); }
        kids[n] = p;
    }
    fprintf(stderr, "LIMIT forks: %d (%s)\n", n, err ? strerror(err) : "no error");
    for (int i = 0; i < n; i++) kill(kids[i], SIGKILL);
    for (int i = 0; i < n; i++) waitpid(kids[i], NULL, 0);
}

static void memory(void) {
    int report[2], go[2];
    pid_t kids[CHILDREN];
    if (pipe(report) || pipe(go)) { perror("pipe"); return; }
    for (int i = 0; i < CHILDREN; i++) {
        kids[i] = fork();
        if (kids[i] == 0) {
            close(report[0]); close(go[1]);
            size_t n = (size_t)CHILD_MIB << 20;
            char *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) _exit(3);
            for (size_t off = 0; off < n; off += 4096) m[off] = (char)(off >> 12 | 1);
            char c = 'x';
            if (write(report[1], &c, 1) != 1) _exit(4);
            read(go[0], &c, 1);  /* holds the memory until the parent closes `go` */
            _exit(0);
        }
    }
    close(report[1]); close(go[0]);
    /* each child either reports (one byte) or dies: wait until every live one has reported */
    int reported = 0, dead[CHILDREN] = {0}, died = 0;
    for (int rounds = 0; rounds < 600; rounds++) {
        struct pollfd p = {report[0], POLLIN, 0};
        if (poll(&p, 1, 100) > 0 && (p.revents & POLLIN)) {
            char c;
            if (read(report[0], &c, 1) == 1) reported++;
        }
        for (int i = 0; i < CHILDREN; i++)
            if (!dead[i] && waitpid(kids[i], NULL, WNOHANG) == kids[i]) { dead[i] = 1; died++; }
        if (reported + died >= CHILDREN || CHILDREN - died <= reported) break;
    }
    nap_ms(300);  /* a limit's kill of a late child lands */
    int holding = 0;
    for (int i = 0; i < CHILDREN; i++) {
        if (dead[i]) continue;
        if (waitpid(kids[i], NULL, WNOHANG) == kids[i]) { dead[i] = 1; died++; }
        else holding++;
    }
    fprintf(stderr, "LIMIT memory: held %d MiB in %d processes at once (%d died)\n", holding * CHILD_MIB, holding,
            died);
    close(go[1]);
    for (int i = 0; i < CHILDREN; i++) if (!dead[i]) waitpid(kids[i], NULL, 0);
}

static int session_open(void) {
    FILE *f = fopen("/proc/net/tcp", "r");
    char line[512];
    int open = 0;
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        unsigned lport, st;
        if (sscanf(line, " %*d: %*8s:%x %*8s:%*x %x", &lport, &st) == 2 && st == 1) open = 1;
    }
    fclose(f);
    return open;
}

static void cache(void) {
    if (fork() != 0) return;
    while (!session_open()) nap_ms(20);
    static char block[1 << 20];
    memset(block, 'c', sizeof block);
    for (int written = 0, k = 0; written < TOTAL_MIB; k++) {
        char path[64];
        snprintf(path, sizeof path, "/cache/fill-%d", k);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0) { fprintf(stderr, "LIMIT cache: open: %s\n", strerror(errno)); _exit(1); }
        for (int i = 0; i < FILE_MIB; i++)
            if (write(fd, block, sizeof block) != sizeof block) { fprintf(stderr, "LIMIT cache: write: %s\n", strerror(errno)); _exit(1); }
        fsync(fd);
        close(fd);
        written += FILE_MIB;
        fprintf(stderr, "LIMIT cache: wrote %d MiB\n", written);
        nap_ms(100);
    }
    fprintf(stderr, "LIMIT cache: done\n");
    _exit(0);
}

static void flood(void) {
    setvbuf(stderr, NULL, _IOFBF, 1 << 16);  /* as fast as the pipe takes it */
    for (int i = 0; i < FLOOD_LINES; i++) fprintf(stderr, "FLOOD %d\n", i);
    fprintf(stderr, "LIMIT flood: done\n");
    fflush(stderr);
}

static void daemon_(void) {
    int ready[2];
    if (pipe(ready)) return;
    pid_t p = fork();
    if (p == 0) {
        setsid();
        if (fork() != 0) _exit(0);
        fprintf(stderr, "LIMIT daemon: started pid %d\n", getpid());
        close(ready[1]);
        for (;;) pause();
    }
    close(ready[1]);
    char c;
    read(ready[0], &c, 1);  /* EOF once the daemon reported */
    close(ready[0]);
    waitpid(p, NULL, 0);
}

int main(int argc, char **argv) {
    setvbuf(stderr, NULL, _IOLBF, 0);
    if (argc < 2) { fprintf(stderr, "usage: payload SERVER [ARGS]\n"); return 2; }
    switch (MODE) {
    case MODE_FORKS: forks(); break;
    case MODE_MEMORY: memory(); break;
    case MODE_CACHE: cache(); break;
    case MODE_FLOOD: flood(); break;
    case MODE_DAEMON: daemon_(); break;
    }
    execv(argv[1], argv + 1);
    fprintf(stderr, "exec %s: %s\n", argv[1], strerror(errno));
    return 127;
}
