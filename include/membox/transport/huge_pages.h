// Transparent huge pages for the shared memory the transport allocates and
// maps (docs/design/transport.md, "Huge pages").
//
// A device-allocated region is System V shared memory (UCX's md:sysv), in
// 4 KiB pages unless the kernel's shmem huge-page policy allows more. A
// node that fills a fresh gigabyte (a replacement copying its state)
// spends most of that time in 262,144 page faults; in 2 MiB pages it is 512.
// With the policy `advise`, the kernel uses huge pages exactly for the
// mappings advised MADV_HUGEPAGE, which these are; with `never` (Debian's
// default) the advice does nothing.
//
// Threading: any thread. No state.
#ifndef MEMBOX_TRANSPORT_HUGE_PAGES_H_
#define MEMBOX_TRANSPORT_HUGE_PAGES_H_

#include <cstddef>
#include <string>

namespace membox::transport {

// Advises the whole 2 MiB extents of [addr, addr + len) MADV_HUGEPAGE. A
// hint: a kernel that refuses it changes nothing.
void AdviseHugePages(void* addr, size_t len);

// Faults [addr, addr + len) in for writing in one call
// (MADV_POPULATE_WRITE, Linux 5.14), before a copy fills it: the kernel
// walks the pages itself instead of taking a fault per 4 KiB page while
// the copy writes them (a 512 MiB memcpy into fresh shared memory here:
// 0.35 s faulting, 0.24 s populated first). A hint: where the kernel
// refuses it, the copy's faults do the same work.
void PopulateForWrite(void* addr, size_t len);

// The kernel's shared-memory huge-page policy: the selected word of
// /sys/kernel/mm/transparent_hugepage/shmem_enabled ("never", "advise",
// "always", ...), or "" where the file is missing or unreadable.
std::string ShmemHugePagePolicy();

}  // namespace membox::transport

#endif  // MEMBOX_TRANSPORT_HUGE_PAGES_H_
