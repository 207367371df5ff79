/* Pins the calling thread's OpenMP team to CPUs, one thread each, as vLLM-CPU's
 * init_cpu_threads_env does. A team's threads are reused by every later parallel region
 * of the same master thread, so the pinning holds for torch's operations too. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

/* Thread i of a team of `num_cpus` (the caller is thread 0) pins itself to cpus[i].
 * Returns how many threads failed to pin (0 on success). */
int bind_threads(const int *cpus, int num_cpus) {
    int failed = 0;
#pragma omp parallel num_threads(num_cpus) reduction(+ : failed)
    {
        int thread = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[thread], &set);
        failed += omp_get_num_threads() != num_cpus
                  || sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed;
}

/* Weak: an OpenMP runtime older than 5.0 lacks it, and the library must still load. */
#pragma weak omp_pause_resource_all

/* The calling thread runs its later parallel regions on itself alone, and the threads of its
 * team end (libgomp then no longer counts them among the threads it manages). Returns 0, or
 * -1 where the runtime cannot end them. */
int release_team(void) {
    omp_set_num_threads(1);
    if (!omp_pause_resource_all)
        return -1;
    return omp_pause_resource_all(omp_pause_hard);
}
