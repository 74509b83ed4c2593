# gnuplot live_memory.gp (run in this folder) draws live_memory.svg and .png
svg_out(name) = sprintf('set terminal svg size 900,520 dynamic font "sans,11"; set output "%s.svg"', name)
png_term = strstrt(GPVAL_TERMINALS, 'pngcairo') > 0 ? 'pngcairo' : 'png'
png_out(name) = sprintf('set terminal %s size 900,520; set output "%s.png"', png_term, name)
do for [k = 1:2] {
  eval(k == 1 ? svg_out('live_memory') : png_out('live_memory'))
  set title 'Live memory over the first steps (from each run''s trace)'
  set xlabel 'training step'
  set ylabel 'live MiB'
  set grid
  set key outside right noenhanced
  set yrange [0:*]
  plot "live_0.dat" using 1:2 with steps lw 1.5 title "all", \
     "live_1.dat" using 1:2 with steps lw 1.5 title "lora", \
     "live_2.dat" using 1:2 with steps lw 1.5 title "baseline", \
     "live_3.dat" using 1:2 with steps lw 1.5 title "amp", \
     "live_4.dat" using 1:2 with steps lw 1.5 title "chunked_loss", \
     "live_5.dat" using 1:2 with steps lw 1.5 title "checkpoint"
}
