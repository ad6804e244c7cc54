// Clang thread-safety analysis attributes (-Wthread-safety), as abseil's thread_annotations.h.
//
// A member written `int count_ GUARDED_BY(mu_);` may be read or written only while `mu_` is
// held; a function declared `void DropLocked() REQUIRES(mu_);` may be called only with `mu_`
// held; `EXCLUDES(mu_)` says the caller must not hold it (the function takes it). The capability
// is a hiqcache::Mutex (hiqcache/mutex.h): std::mutex is not annotated in libstdc++. Clang checks
// the annotations at compile time (ctest thread_safety); on other compilers they expand to
// nothing. abseil's legacy absl/base/internal/thread_annotations.h (reached through gRPC's
// headers) defines six of these names (GUARDED_BY, PT_GUARDED_BY, ACQUIRED_AFTER/BEFORE,
// LOCK_RETURNED, NO_THREAD_SAFETY_ANALYSIS) as the same attributes: those are defined here only
// where it did not. Thread-safety: macros only.
#pragma once

#if defined(__clang__)
#define HIQ_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define HIQ_THREAD_ANNOTATION(x)
#endif

// The member is read and written only while the named capability is held.
#ifndef GUARDED_BY
#define GUARDED_BY(x) HIQ_THREAD_ANNOTATION(guarded_by(x))
#endif
// What the pointer member points to is accessed only while the capability is held.
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) HIQ_THREAD_ANNOTATION(pt_guarded_by(x))
#endif

// Lock order: this capability is taken after (before) the named ones.
#ifndef ACQUIRED_AFTER
#define ACQUIRED_AFTER(...) HIQ_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#endif
#ifndef ACQUIRED_BEFORE
#define ACQUIRED_BEFORE(...) HIQ_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#endif

// The caller holds the capabilities (exclusively / shared) on entry and on return.
#define REQUIRES(...) HIQ_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) HIQ_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))

// The caller does not hold the capabilities (the function takes them).
#define EXCLUDES(...) HIQ_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))

// The function returns a reference to the named capability.
#ifndef LOCK_RETURNED
#define LOCK_RETURNED(x) HIQ_THREAD_ANNOTATION(lock_returned(x))
#endif

// The class is a capability (a lock) / an RAII holder of one.
#define CAPABILITY(x) HIQ_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY HIQ_THREAD_ANNOTATION(scoped_lockable)

// The function takes / gives back the capabilities (none named: `this`).
#define ACQUIRE(...) HIQ_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) HIQ_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) HIQ_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) HIQ_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define RELEASE_GENERIC(...) HIQ_THREAD_ANNOTATION(release_generic_capability(__VA_ARGS__))

// The function tries to take the capabilities; the first argument is the success return value.
#define TRY_ACQUIRE(...) HIQ_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define TRY_ACQUIRE_SHARED(...) HIQ_THREAD_ANNOTATION(try_acquire_shared_capability(__VA_ARGS__))

// The function checks at run time that the capability is held; the analysis then assumes it.
#define ASSERT_CAPABILITY(x) HIQ_THREAD_ANNOTATION(assert_capability(x))
#define ASSERT_SHARED_CAPABILITY(x) HIQ_THREAD_ANNOTATION(assert_shared_capability(x))

// The function is not checked. Each use says why the analysis cannot follow it.
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS HIQ_THREAD_ANNOTATION(no_thread_safety_analysis)
#endif
