// OpenMP thread placement: pin each thread of the calling thread's OpenMP pool to its own CPU
// set (what vLLM-CPU's init_cpu_threads_env does), and read the placement back.
//
// libgomp keeps one thread pool per master thread and reuses its threads in team order, so
// thread t of a `num_threads(n)` team started here is thread t of every later n-thread team the
// same master starts -- torch's parallel regions included, once torch.set_num_threads(n) has
// set the master's thread count. Linux only: sched_setaffinity(0, ...) is the calling thread.
#include <omp.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>

#include "ops.h"

#if defined(__linux__)
#include <sched.h>
#endif

namespace sous {
namespace {

#if defined(__linux__)
// The CPUs the calling thread may run on, ascending (empty if the call fails).
std::vector<int64_t> current_cpus() {
  std::vector<int64_t> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}
#endif

}  // namespace

std::vector<std::vector<int64_t>> pin_omp_threads(
    const std::vector<std::vector<int64_t>>& cpu_sets) {
#if defined(__linux__)
  const int n = static_cast<int>(cpu_sets.size());
  TORCH_CHECK(n > 0, "pin_omp_threads: no CPU sets given");
  for (const auto& cpus : cpu_sets) {
    TORCH_CHECK(!cpus.empty(), "pin_omp_threads: an empty CPU set");
    for (int64_t c : cpus) {
      TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "pin_omp_threads: CPU ", c, " out of range");
    }
  }
  std::vector<std::vector<int64_t>> placed(n);
  std::vector<int> errors(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int64_t c : cpu_sets[t]) CPU_SET(static_cast<int>(c), &set);
    errors[t] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
    placed[t] = current_cpus();
  }
  for (int t = 0; t < n; ++t) {
    TORCH_CHECK(errors[t] == 0, "sched_setaffinity failed for OpenMP thread ", t, ": ",
                std::strerror(errors[t]));
  }
  return placed;  // a thread the runtime did not start (team smaller than n) stays empty
#else
  TORCH_CHECK(false, "pin_omp_threads: per-thread CPU binding needs Linux");
#endif
}

std::vector<std::vector<int64_t>> omp_thread_cpus(int64_t num_threads) {
#if defined(__linux__)
  TORCH_CHECK(num_threads > 0, "omp_thread_cpus: num_threads must be > 0");
  const int n = static_cast<int>(num_threads);
  std::vector<std::vector<int64_t>> placed(n);
#pragma omp parallel num_threads(n)
  placed[omp_get_thread_num()] = current_cpus();
  return placed;
#else
  TORCH_CHECK(false, "omp_thread_cpus: needs Linux");
#endif
}

}  // namespace sous
