// Clang thread-safety annotations (checked with -Wthread-safety when building with clang; no-ops on gcc).
// Members are grouped under "Guarded by mu_" and annotated, as in leveldb.
#ifndef ORBITKV_BASE_THREAD_ANNOTATIONS_H_
#define ORBITKV_BASE_THREAD_ANNOTATIONS_H_

#if defined(__clang__)
#define ORBITKV_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define ORBITKV_THREAD_ANNOTATION_(x)
#endif

// Abseil's legacy header (absl/base/internal/thread_annotations.h, pulled in by its containers)
// defines three of these names too, to the same attributes: ours replace them whichever comes first.
#undef GUARDED_BY
#undef PT_GUARDED_BY
#undef NO_THREAD_SAFETY_ANALYSIS

#define CAPABILITY(x) ORBITKV_THREAD_ANNOTATION_(capability(x))
#define SCOPED_CAPABILITY ORBITKV_THREAD_ANNOTATION_(scoped_lockable)
#define GUARDED_BY(x) ORBITKV_THREAD_ANNOTATION_(guarded_by(x))
#define PT_GUARDED_BY(x) ORBITKV_THREAD_ANNOTATION_(pt_guarded_by(x))
#define REQUIRES(...) ORBITKV_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) ORBITKV_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) ORBITKV_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define RELEASE(...) ORBITKV_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS ORBITKV_THREAD_ANNOTATION_(no_thread_safety_analysis)

#endif  // ORBITKV_BASE_THREAD_ANNOTATIONS_H_
