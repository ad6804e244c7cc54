# Renders replay_bench's sweep: hit rate against host budget for BF16, padded INT8 (HiQCache),
# hiqcache's INT8, and its FP8 E4M3 and INT4 g32 codecs (which fail the fidelity gates). replay_bench runs it as
#   gnuplot -e "datafile='.../replay_sweep.dat'; outfile='.../replay_hit_rate.png'; \
#               ref_bf16=56.1; ref_int8=72.7; ref_budget=8; l1_only=17.5; subtitle='...'" \
#           bench/plot_replay.gp
# (every variable has a default, so `gnuplot bench/plot_replay.gp` replots the checked-in data).
# Columns of the data file: budget_gb, then per configuration prefix hit %, L2 hit %, capacity.
if (!exists("datafile")) datafile = 'bench/results/replay/replay_sweep.dat'
if (!exists("outfile")) outfile = 'bench/results/replay/replay_hit_rate.png'
if (!exists("ref_budget")) ref_budget = 8
if (!exists("ref_bf16")) ref_bf16 = 56.1
if (!exists("ref_int8")) ref_int8 = 72.7
if (!exists("subtitle")) subtitle = '32 x 2,048-token prefix groups, 128 requests, L1 16,384 tokens'

set terminal pngcairo size 1400,560 enhanced font 'DejaVu Sans,11'
set output outfile
set datafile missing 'NaN'
set key top left
set grid
set xrange [0:*]
set yrange [0:100]
set xlabel 'host budget (GB, Qwen3-8B geometry)'
set style line 1 lc rgb '#7f7f7f' lw 2 pt 7 ps 1.0
set style line 2 lc rgb '#1f77b4' lw 2 pt 5 ps 1.0
set style line 3 lc rgb '#d62728' lw 2.5 pt 9 ps 1.2
set style line 4 lc rgb '#ff7f0e' lw 1.5 pt 11 ps 0.9 dt 2
set style line 5 lc rgb '#9467bd' lw 1.5 pt 13 ps 0.9 dt 2
set arrow 1 from ref_budget, graph 0 to ref_budget, graph 1 nohead dt 3 lc rgb '#999999'

if (exists("l1_only")) set arrow 2 from graph 0, first l1_only to graph 1, first l1_only nohead dt 2 lw 1.5 lc rgb '#2ca02c'
if (exists("l1_only")) set label 2 sprintf('L1 alone (no L2): %.1f%%', l1_only) at graph 0.55, first l1_only + 2.5 tc rgb '#2ca02c'
set multiplot layout 1,2 title 'replay against hiqcached: '.subtitle
set title 'prefix hit rate (L1 + L2 tokens / prompt tokens)'
set ylabel 'hit rate (%)'
plot datafile u 1:2 w lp ls 1 t 'BF16 (147,456 B/token)', \
     '' u 1:5 w lp ls 2 t 'INT8 padded, HiQCache (82,944 B/token)', \
     '' u 1:8 w lp ls 3 t 'INT8 hiqcache (74,880 B/token)', \
     '' u 1:11 w lp ls 4 t 'FP8 E4M3 (74,880 B/token; fails fidelity KL gate)', \
     '' u 1:14 w lp ls 5 t 'INT4 g32 (41,472 B/token; fidelity: not recommended)', \
     '+' u (ref_budget):(ref_bf16) every ::0::0 w p pt 6 ps 2 lc rgb '#7f7f7f' t 'published BF16 (SGLang, A6000)', \
     '+' u (ref_budget):(ref_int8) every ::0::0 w p pt 4 ps 2 lc rgb '#1f77b4' t 'published INT8 (SGLang, A6000)'
unset arrow 2
unset label 2
set title 'L2 hit rate (tokens restored from hiqcached / tokens looked up there)'
plot datafile u 1:3 w lp ls 1 t 'BF16', \
     '' u 1:6 w lp ls 2 t 'INT8 padded (HiQCache)', \
     '' u 1:9 w lp ls 3 t 'INT8 hiqcache', \
     '' u 1:12 w lp ls 4 t 'FP8 E4M3', \
     '' u 1:15 w lp ls 5 t 'INT4 g32'
unset multiplot
