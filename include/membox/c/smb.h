/* The Soft Memory Box C API (seed 003, Table 1), served by `membox serve`.
 *
 *   smb_init()       connect to the memory node named by the environment
 *                    (MEMBOX_SERVER=host:port, MEMBOX_SECRET or
 *                    MEMBOX_SECRET_FILE) or by the config file MEMBOX_CONFIG
 *                    (lines "server = host:port", "secret = ...",
 *                    "secret_file = PATH"). Returns 0 or a negative error.
 *   smb_terminate()  detach everything and disconnect.
 *   shm_alloc(&key, size, flags)
 *                    SMB_CREATE: create a segment as master (*key == 0 lets the
 *                    server choose and stores it in *key); SMB_ATTACH: attach
 *                    the segment *key of exactly `size` bytes. Returns the
 *                    local cache buffer of the segment, or NULL on error.
 *   shm_free(ptr)    the master deletes, others detach; 0 or a negative
 *                    error (e.g. -3 for a pointer that is not a segment).
 *   shm_get_key(ptr) the key of the segment whose buffer contains ptr (0:
 * none). shm_rsync(ptr, size) / shm_wsync(ptr, size) read-sync remote -> local
 * / write-sync local -> remote for [ptr, ptr + size) inside one segment's
 * buffer. shm_accum(dst, src, size, type) on the server: dst += src over `size`
 * bytes starting at the offsets of dst and src in their segments (which must be
 * equal); type SMB_FLOAT, SMB_DOUBLE, SMB_FLOAT16 or SMB_BFLOAT16. Returns when
 * the result is visible.
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

int smb_init(void);
void smb_terminate(void);
void* shm_alloc(uint64_t* key, uint64_t size, int shmflg);
int shm_free(void* ptr);
uint64_t shm_get_key(void* ptr);
int shm_rsync(void* ptr, size_t size);
int shm_wsync(void* ptr, size_t size);
int shm_accum(void* dst, void* src, size_t size, unsigned int type);
const char* smb_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMBOX_C_SMB_H_ */
