# Renders compare_lmcache.py's results: per arm, the TTFT of a restored 2,048-token prefix (same
# and fresh engine process), experiment B's warm-round prefix hit rate and TTFT, and the tokens
# each tier holds per GiB. compare_lmcache.py runs it as
#   gnuplot -e "datafile='.../vllm_lmcache.dat'; outfile='.../vllm_lmcache.png'; subtitle='...'" \
#           bench/vllm/plot_lmcache.gp
# (every variable has a default, so `gnuplot bench/vllm/plot_lmcache.gp` replots the checked-in
# data). Columns: arm, ttft_same_ms, ttft_fresh_ms, hit_rate_pct, workload_ttft_ms, tokens_per_gib.
if (!exists("datafile")) datafile = 'bench/results/vllm/vllm_lmcache.dat'
if (!exists("outfile")) outfile = 'bench/results/vllm/vllm_lmcache.png'
if (!exists("subtitle")) subtitle = 'SmolLM2-135M on vLLM-CPU'

set terminal pngcairo size 1400,960 enhanced font 'DejaVu Sans,10'
set output outfile
set datafile missing 'NaN'
set style data histograms
set style fill solid 0.85 border -1
set boxwidth 0.85
set grid ytics
set xtics rotate by -30 scale 0 noenhanced
set key top right
set tmargin 3
set bmargin 5
set multiplot layout 2,2 title 'LMCache beside hiqcached under vLLM: '.subtitle

set title 'TTFT, 2,064-token prompt, 2,048-token prefix in the tier (log)'
set ylabel 'ms'
set logscale y
set style histogram clustered gap 1
plot datafile u 2:xtic(1) t 'same process (vLLM alone: its own prefix cache)' lc rgb '#1f77b4', \
     '' u 3 t 'fresh process (vLLM alone: recompute)' lc rgb '#ff7f0e'

unset logscale y
set title 'experiment B: warm-round prefix hit rate (same byte budget)'
set ylabel 'hit rate (%)'
set yrange [0:105]
plot datafile u 4:xtic(1) notitle lc rgb '#2ca02c', \
     '' u 0:4:(sprintf('%.1f%%', $4)) w labels offset 0,0.8 notitle
set yrange [*:*]

set title 'experiment B: median TTFT of the warm rounds (log)'
set ylabel 'ms'
set logscale y
plot datafile u 5:xtic(1) notitle lc rgb '#d62728', \
     '' u 0:5:(sprintf('%.0f ms', $5)) w labels offset 0,0.8 notitle
unset logscale y

set title 'tokens held per GiB of the tier'
set ylabel 'tokens'
set format y '%.0s%c'
set yrange [0:*]
plot datafile u 6:xtic(1) notitle lc rgb '#9467bd', \
     '' u 0:6:(sprintf('%.0f', $6)) w labels offset 0,0.8 notitle
unset multiplot
