/* A C program using the SMB C API (include/membox/c/smb.h) against a real
 * `membox serve`, driven by memserver_daemon_test. Modes:
 *   roundtrip          create, write-sync, attach through a second key,
 *                      accumulate, read back; prints OK
 *   wsync-loop KEY MiB attach segment KEY and write-sync it forever (to be
 *                      killed); prints LOOPING once the first sync is done
 *   init               only smb_init; prints the error on failure */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "membox/c/smb.h"

static int fail(const char* what) {
  fprintf(stderr, "smb_c_client: %s: %s\n", what, smb_last_error());
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  int rc = smb_init();
  if (rc != 0) {
    printf("INIT %d %s\n", rc, smb_last_error());
    return 3;
  }
  if (strcmp(argv[1], "init") == 0) {
    printf("OK\n");
    smb_terminate();
    return 0;
  }
  if (strcmp(argv[1], "roundtrip") == 0) {
    const size_t n = 1 << 18;
    uint64_t wkey = 0, gkey = 4242;
    float* w = shm_alloc(&wkey, n * sizeof(float), SMB_CREATE);
    float* g = shm_alloc(&gkey, n * sizeof(float), SMB_CREATE);
    if (!w || !g) return fail("shm_alloc");
    if (wkey == 0 || shm_get_key(w) != wkey || shm_get_key(g) != 4242)
      return fail("keys");
    for (size_t i = 0; i < n; ++i) {
      w[i] = 1.0f;
      g[i] = (float)(i % 5);
    }
    if (shm_wsync(w, n * sizeof(float)) || shm_wsync(g, n * sizeof(float)))
      return fail("wsync");
    if (shm_accum(w, g, n * sizeof(float), SMB_FLOAT)) return fail("accum");
    memset(w, 0, n * sizeof(float));
    if (shm_rsync(w, n * sizeof(float))) return fail("rsync");
    for (size_t i = 0; i < n; ++i) {
      if (w[i] != 1.0f + (float)(i % 5)) {
        fprintf(stderr, "w[%zu] = %f\n", i, w[i]);
        return 4;
      }
    }
    /* Errors: bad pointer, wrong dtype, attach with the wrong size. */
    int stray = 0;
    if (shm_rsync(&stray, 4) == 0)
      return fail("rsync of a stray pointer succeeded");
    if (shm_accum(w, g, n * sizeof(float), 99) == 0)
      return fail("bad dtype accepted");
    uint64_t k = wkey;
    if (shm_alloc(&k, 12345, SMB_ATTACH) != NULL)
      return fail("wrong size attached");
    if (shm_free(&stray) >= 0)
      return fail("shm_free of a stray pointer succeeded");
    if (shm_free(g) != 0) return fail(smb_last_error());
    if (shm_free(w) != 0) return fail(smb_last_error());
    if (shm_free(w) >= 0) return fail("double shm_free succeeded");
    smb_terminate();
    printf("OK\n");
    return 0;
  }
  if (strcmp(argv[1], "wsync-loop") == 0 && argc == 4) {
    uint64_t key = strtoull(argv[2], NULL, 10);
    size_t bytes = (size_t)strtoull(argv[3], NULL, 10) << 20;
    char* p = shm_alloc(&key, bytes, SMB_ATTACH);
    if (!p) return fail("attach");
    memset(p, 0x33, bytes);
    for (int i = 0;; ++i) {
      if (shm_wsync(p, bytes)) return fail("wsync");
      if (i == 0) {
        printf("LOOPING\n");
        fflush(stdout);
      }
    }
  }
  return 2;
}
