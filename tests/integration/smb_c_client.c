/* A C program using the SMB C API (include/membox/c/smb.h) against a real
 * `membox serve`, driven by memserver_daemon_test. Modes:
 *   roundtrip          create (a server-chosen and an own key), write-sync,
 *                      accumulate, read back, key text round trip; prints OK
 *   wsync-loop KEY MiB attach segment KEY (32 hex digits) and write-sync it
 *                      forever (to be killed); prints LOOPING once the first
 *                      sync is done
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
    smb_key_t wkey = {0, 0}, gkey = {0, 4242}, own = {0, 4242};
    float* w = shm_alloc(&wkey, n * sizeof(float), SMB_CREATE);
    float* g = shm_alloc(&gkey, n * sizeof(float), SMB_CREATE);
    if (!w || !g) return fail("shm_alloc");
    /* A server-chosen key is 128 random bits: both words are zero with
     * probability 2^-64 each. */
    if ((wkey.hi == 0 && wkey.lo == 0) ||
        !smb_key_equal(shm_get_key(w), wkey) ||
        !smb_key_equal(shm_get_key(g), own))
      return fail("keys");
    char text[SMB_KEY_STRLEN];
    smb_key_t back = {0, 0};
    smb_key_format(wkey, text);
    if (strlen(text) != 32 || smb_key_parse(text, &back) != 0 ||
        !smb_key_equal(back, wkey))
      return fail("key text round trip");
    if (smb_key_parse("4242", &back) != -3 ||
        smb_key_parse("0123456789abcdef0123456789abcdeg", &back) != -3)
      return fail("bad key text accepted");
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
    smb_key_t k = wkey;
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
    smb_key_t key;
    if (smb_key_parse(argv[2], &key) != 0) return fail("key");
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
