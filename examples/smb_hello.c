/* A C program against an installed membox (smb.h, seed 003's API):
 *   cc smb_hello.c $(pkg-config --cflags --libs membox) -o smb_hello
 *   MEMBOX_SERVER=host:7300 MEMBOX_SECRET_FILE=/etc/membox.secret ./smb_hello
 * Creates a segment, writes it, accumulates it into itself on the memory
 * node (x += x), reads it back, frees it. */
#include <membox/c/smb.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  if (smb_init() != 0) {
    fprintf(stderr, "smb_init: %s\n", smb_last_error());
    return 1;
  }
  enum { N = 1024 };
  smb_key_t a = {0, 0}, b = {0, 0}; /* zero: the server picks random keys */
  float* x = shm_alloc(&a, N * sizeof(float), SMB_CREATE);
  float* y = shm_alloc(&b, N * sizeof(float), SMB_CREATE);
  if (x == NULL || y == NULL) {
    fprintf(stderr, "shm_alloc: %s\n", smb_last_error());
    return 1;
  }
  for (int i = 0; i < N; ++i) x[i] = y[i] = (float)i;
  if (shm_wsync(x, N * sizeof(float)) != 0 ||
      shm_wsync(y, N * sizeof(float)) != 0 ||
      shm_accum(x, y, N * sizeof(float), SMB_FLOAT) != 0 ||
      shm_rsync(x, N * sizeof(float)) != 0) {
    fprintf(stderr, "sync/accumulate: %s\n", smb_last_error());
    return 1;
  }
  for (int i = 0; i < N; ++i) {
    if (x[i] != 2.0f * (float)i) {
      fprintf(stderr, "x[%d] = %f, expected %f\n", i, x[i], 2.0f * i);
      return 1;
    }
  }
  if (shm_free(y) != 0 || shm_free(x) != 0) {
    fprintf(stderr, "shm_free: %s\n", smb_last_error());
    return 1;
  }
  if (shm_free(x) == 0) {
    fprintf(stderr, "a second shm_free of the same buffer succeeded\n");
    return 1;
  }
  smb_terminate();
  char ka[SMB_KEY_STRLEN], kb[SMB_KEY_STRLEN];
  smb_key_format(a, ka);
  smb_key_format(b, kb);
  printf("OK segments %s %s\n", ka, kb);
  return 0;
}
