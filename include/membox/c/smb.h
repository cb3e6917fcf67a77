/* The Soft Memory Box C API (seed 003, Table 1), served by `membox serve`.
 *
 *   smb_init()       connect to the memory node named by the environment
 *                    (MEMBOX_SERVER=host:port, MEMBOX_SECRET or
 *                    MEMBOX_SECRET_FILE) or by the config file MEMBOX_CONFIG
 *                    (lines "server = host:port", "secret = ...",
 *                    "secret_file = PATH"). Returns 0 or a negative error.
 *   smb_terminate()  detach everything and disconnect.
 *   shm_alloc(&key, size, flags)
 *                    SMB_CREATE: create a segment as master (a zero key lets
 *                    the server choose a random one and stores it in *key);
 *                    SMB_ATTACH: attach the segment *key of exactly `size`
 *                    bytes. Returns the local cache buffer of the segment, or
 *                    NULL on error.
 *   shm_free(ptr)    the master deletes, others detach; 0 or a negative
 *                    error (e.g. -3 for a pointer that is not a segment).
 *   shm_get_key(ptr) the key of the segment whose buffer contains ptr (zero:
 * none). shm_rsync(ptr, size) / shm_wsync(ptr, size) read-sync remote -> local
 * / write-sync local -> remote for [ptr, ptr + size) inside one segment's
 * buffer. shm_accum(dst, src, size, type) on the server: dst += src over `size`
 * bytes starting at the offsets of dst and src in their segments (which must be
 * equal); type SMB_FLOAT, SMB_DOUBLE, SMB_FLOAT16 or SMB_BFLOAT16. Returns when
 * the result is visible.
 *
 * Keys are 128 bits (smb_key_t): a key names a segment of the caller's own
 * principal (its credential), and keys the server chooses come from a
 * CSPRNG, so knowing or guessing a key opens nothing of another tenant's.
 * An application may pick its own, e.g. smb_key_t k = {0, 4242}. To pass a
 * key to another process, smb_key_format writes it as 32 hex digits and
 * smb_key_parse reads them back (0, or -3 for text that is not a key).
 *
 * Errors: functions returning int give 0 or -(membox StatusCode); the ones
 * returning pointers give NULL. smb_last_error() is the message of the last
 * failure in the calling thread. All functions are thread-safe. */
#ifndef MEMBOX_C_SMB_H_
#define MEMBOX_C_SMB_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { SMB_ATTACH = 0, SMB_CREATE = 1 };
enum { SMB_FLOAT = 1, SMB_DOUBLE = 2, SMB_FLOAT16 = 3, SMB_BFLOAT16 = 4 };

/* A segment key: 128 bits, hi word first in its text form. */
typedef struct smb_key {
  uint64_t hi;
  uint64_t lo;
} smb_key_t;
#define SMB_KEY_STRLEN 33 /* 32 hex digits and the terminating NUL */

int smb_init(void);
void smb_terminate(void);
void* shm_alloc(smb_key_t* key, uint64_t size, int shmflg);
int shm_free(void* ptr);
smb_key_t shm_get_key(void* ptr);
void smb_key_format(smb_key_t key, char out[SMB_KEY_STRLEN]);
int smb_key_parse(const char* text, smb_key_t* key);
int smb_key_equal(smb_key_t a, smb_key_t b);
int shm_rsync(void* ptr, size_t size);
int shm_wsync(void* ptr, size_t size);
int shm_accum(void* dst, void* src, size_t size, unsigned int type);
const char* smb_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMBOX_C_SMB_H_ */
