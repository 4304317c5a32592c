/* LD_PRELOAD shim: give a ggml tool that has no --rpc flag (test-backend-ops) the RPC device.
 *
 * test-backend-ops enumerates devices right after it calls ggml_backend_load_all(); this shim
 * defines that function, runs the real one (found with dlsym(RTLD_NEXT)), then, for every
 * endpoint in $RPCGUARD_RPC_ENDPOINTS (comma separated host:port), does what llama.cpp's own
 * --rpc option does (common/arg.cpp): ggml_backend_rpc_add_server(endpoint), which asks the server
 * for its device count and returns a backend reg with devices RPC0, RPC1, ..., and
 * ggml_backend_register(reg), which registers the reg and each of its devices.
 * Then `test-backend-ops test -b RPC0 -o OP` runs OP's cases on the remote server and compares
 * every result with the local CPU backend.
 *
 * Build (tests/realpeer/tools.sh does): cc -shared -fPIC -I<tree>/ggml/include shim.c
 *   -L<bin> -lggml-rpc -lggml-base -ldl -Wl,-rpath,<bin>
 * Our own code; only the ggml headers of the tree it is built against are used.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml-rpc.h"

#define ENV_NAME "RPCGUARD_RPC_ENDPOINTS"

static void register_endpoints(void) {
    static int done = 0;
    if (done++) {
        return;
    }
    const char * env = getenv(ENV_NAME);
    if (env == NULL || *env == '\0') {
        return;
    }
    char * list = strdup(env);
    char * save = NULL;
    for (char * ep = strtok_r(list, ",", &save); ep != NULL; ep = strtok_r(NULL, ",", &save)) {
        ggml_backend_reg_t reg = ggml_backend_rpc_add_server(ep);
        if (reg == NULL) {
            fprintf(stderr, "rpc_device_shim: %s reports no devices\n", ep);
            exit(3);
        }
        ggml_backend_register(reg);
        fprintf(stderr, "rpc_device_shim: registered %zu device(s) of %s\n", ggml_backend_reg_dev_count(reg), ep);
    }
    free(list);
}

void ggml_backend_load_all(void) {
    void (*real)(void) = (void (*)(void)) dlsym(RTLD_NEXT, "ggml_backend_load_all");
    if (real != NULL) {
        real();
    }
    register_endpoints();
}
