// Clang thread-safety analysis attributes (-Wthread-safety, on for clang
// builds; see cmake/MemboxHelpers.cmake). With GCC they expand to nothing.
// Prefixed: abseil (through gRPC) defines the unprefixed names.
// Use them with membox::Mutex (base/mutex.h): libstdc++'s std::mutex carries
// no capability attributes, so members guarded by one are not checked.
#ifndef MEMBOX_BASE_THREAD_ANNOTATIONS_H_
#define MEMBOX_BASE_THREAD_ANNOTATIONS_H_

#if defined(__clang__)
#define MEMBOX_TSA(x) __attribute__((x))
#else
#define MEMBOX_TSA(x)
#endif

#define MEMBOX_CAPABILITY(x) MEMBOX_TSA(capability(x))
#define MEMBOX_SCOPED_CAPABILITY MEMBOX_TSA(scoped_lockable)
#define MEMBOX_GUARDED_BY(x) MEMBOX_TSA(guarded_by(x))
#define MEMBOX_PT_GUARDED_BY(x) MEMBOX_TSA(pt_guarded_by(x))
#define MEMBOX_REQUIRES(...) MEMBOX_TSA(requires_capability(__VA_ARGS__))
#define MEMBOX_EXCLUDES(...) MEMBOX_TSA(locks_excluded(__VA_ARGS__))
#define MEMBOX_ACQUIRE(...) MEMBOX_TSA(acquire_capability(__VA_ARGS__))
#define MEMBOX_RELEASE(...) MEMBOX_TSA(release_capability(__VA_ARGS__))
#define MEMBOX_TRY_ACQUIRE(...) MEMBOX_TSA(try_acquire_capability(__VA_ARGS__))
#define MEMBOX_ASSERT_CAPABILITY(x) MEMBOX_TSA(assert_capability(x))
#define MEMBOX_NO_THREAD_SAFETY_ANALYSIS MEMBOX_TSA(no_thread_safety_analysis)

#endif  // MEMBOX_BASE_THREAD_ANNOTATIONS_H_
