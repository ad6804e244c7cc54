# Renders bench/fidelity/fidelity.py's results: next-token KL(reference || path) and top-1
# agreement with the reference against prefix length, one line per codec and the bf16 noise
# floor (no codec), mean ± SE over windows. fidelity.py runs it as
#   gnuplot -e "datafile='bench/results/fidelity/fidelity.dat'; outfile='bench/results/fidelity/fidelity.png'; \
#               subtitle='...'; has_raw=1" bench/fidelity/plot_fidelity.gp
# (every variable has a default, so `gnuplot bench/fidelity/plot_fidelity.gp` replots the
# checked-in data). Data: one block per path (gnuplot index), its first row the path's name,
# then prefix_tokens kl_mean kl_se top1_pct top1_se_pct ppl ppl_se. Blocks: the floor first, raw
# last when has_raw (drawn dotted over the floor, which it must equal), the codecs between.
# The gates (bench/fidelity/README.md) are drawn as horizontal lines from gatesfile (floor_kl,
# floor_top1: the floor's means over all windows): KL 1.5x and 3x the floor, top-1 1 and 3
# points below it. A gate applies to a codec's mean over all windows, not to each length.
if (!exists("datafile")) datafile = 'bench/results/fidelity/fidelity.dat'
if (!exists("outfile")) outfile = 'bench/results/fidelity/fidelity.png'
if (!exists("has_raw")) has_raw = 1
if (!exists("gatesfile")) gatesfile = 'bench/results/fidelity/fidelity.gates'
load gatesfile
if (!exists("subtitle")) subtitle = 'SmolLM2-135M-Instruct bf16, GPL-3 text + chat windows'

stats datafile u 1 nooutput
npaths = STATS_blocks
# Line styles: 1 the floor, 2 raw, then one per codec (3-7, 10-14; 8 and 9 are the gates').
style(i) = (i == 0) ? 1 : ((has_raw && i == npaths - 1) ? 2 : \
           (i + 2 <= 7 ? i + 2 : (i + 4 <= 14 ? i + 4 : 14)))

set terminal pngcairo size 1400,560 enhanced font 'DejaVu Sans,11'
set output outfile
set datafile missing 'NaN'
set key top left box opaque noenhanced
set grid
set logscale x 2
set xrange [90:2900]
set xtics (128, 256, 512, 1024, 2048)
set xlabel 'prefix length (tokens)'
set style line 1 lc rgb '#000000' lw 2.5 dt 2 pt 7 ps 1.0
set style line 2 lc rgb '#7f7f7f' lw 1.5 dt 3 pt 6 ps 1.8
set style line 3 lc rgb '#d62728' lw 2 pt 5 ps 1.0
set style line 4 lc rgb '#1f77b4' lw 2 pt 9 ps 1.0
set style line 5 lc rgb '#2ca02c' lw 2 pt 11 ps 1.0
set style line 6 lc rgb '#9467bd' lw 2 pt 13 ps 1.0
set style line 7 lc rgb '#ff7f0e' lw 2 pt 15 ps 1.0
set style line 10 lc rgb '#8c564b' lw 2 pt 4 ps 1.0
set style line 11 lc rgb '#e377c2' lw 2 pt 8 ps 1.0
set style line 12 lc rgb '#17becf' lw 2 pt 10 ps 1.0
set style line 13 lc rgb '#bcbd22' lw 2 pt 12 ps 1.0
set style line 14 lc rgb '#393b79' lw 2 pt 14 ps 1.0
set multiplot layout 1,2 title "hiqcached codecs against the bf16 noise floor: ".subtitle noenhanced
set title 'next-token KL(reference || path), nats (mean ± SE over windows)'
set logscale y
set format y '%.0e'
set yrange [5e-4:40]  # headroom above the data for the key
# Block 0 is the floor; raw (if measured) lies exactly on it.
set style line 8 lc rgb '#555555' lw 1.2 dt 4
set style line 9 lc rgb '#aaaaaa' lw 1.2 dt 4
plot for [i=0:npaths-1] datafile index i u 1:2:3 w yerrorlines ls style(i) \
     title columnheader(1), \
     1.5 * floor_kl w l ls 8 title 'gate: mean KL <= 1.5x floor (INT8, FP8, KIVI, Hadamard, allot)', \
     3 * floor_kl w l ls 9 title 'gate: mean KL <= 3x floor (4-bit fallback: not recommended)'
unset logscale y
set format y '%g'
set title 'top-1 agreement with the reference (%)'
set key bottom left
set yrange [72:100.5]  # room below the data for the key
plot for [i=0:npaths-1] datafile index i u 1:4:5 w yerrorlines ls style(i) \
     title columnheader(1), \
     floor_top1 - 1 w l ls 8 title 'gate: top-1 >= floor - 1 point (INT8, FP8, KIVI, Hadamard, allot)', \
     floor_top1 - 3 w l ls 9 title 'gate: top-1 >= floor - 3 points (4-bit fallback: not recommended)'

unset multiplot
